"""Call agreement of the internode kernels' host side at several GPUs per node (deepcomm/internode/hier_kernels.py,
hier_agree.py, deferred_agree.py), on the CPU: the ranks are threads and the launches are recorded instead of run
(tests/helpers/hier_stand_ins.py). 2 nodes x 2 GPUs:

- a fresh dispatch's count round carries every rank's words through the strip, so ranks whose count rows differ
  in length (num_experts) or a rank that rejected its dispatch still raise the reference text on every rank;
- a cached dispatch and a combine ask their launch to take every rank's words into the strip (``words_at``; a
  combine's header then holds every node GPU's words), and the host compares the strip after the launch: with the
  strip filled as the kernels' contract says (rank s's words at ``strip_slot(s)``), a disagreement is the
  reference text;
- a rejected cached dispatch or combine launches the same kernel with no rows, its words in the headers.
The kernels themselves run in tests/agreement/test_agree_internode_gpu.py."""
from __future__ import annotations

import pytest
import torch

from deepcomm import agreement
from deepcomm.internode import hier_agree, hier_kernels
from deepcomm.internode.internode_rows import RAIL_HEADER_BYTES, max_node_row_bytes
from tests.helpers.threaded_world import World, run
from tests.helpers.hier_stand_ins import recording_kernels, recording_world
from tests.internode.test_hier_launch_args import C, E, H, K, M

pytestmark = pytest.mark.skipif(C is None, reason="deepcomm._C is not built (no nvcc at install time)")

NODES, GPN, BUF = 2, 2, 1
R = NODES * GPN


def _world():
    return World(R, GPN, area_bytes=R * M * max_node_row_bytes(H) + hier_agree.strip_bytes(R), timeout_s=120.0)


def _inputs(rank: int):
    gen = torch.Generator().manual_seed(rank)
    T = 5 + rank
    idx = torch.rand(T, 2 * E, generator=gen).topk(K, dim=1).indices % E
    return (torch.randn(T, H, generator=gen).to(torch.bfloat16), idx.contiguous(), torch.rand(T, K, generator=gen))


def _with_send_area(k):
    """The recorded transport with memory for the headers the host writes before a launch."""
    k.tr.region = torch.zeros(k.tr.offsets["recv"] + R * k.tr.slot_bytes, dtype=torch.uint8)
    k.tr.world_size = R
    return k


def _outcome(f) -> str:
    try:
        f()
        return "ok"
    except ValueError as e:
        return str(e)


def _expected(rows) -> str:
    return _outcome(lambda: agreement.check(rows))


@pytest.mark.parametrize("odd", ["num_experts", "rejected"])
def test_fresh_dispatch_count_round_compares_every_rank(monkeypatch, odd):
    """Rank 3 (neither rank 0's node nor its rail) counts for twice the experts, so its count row is longer; or
    rejects its dispatch and joins the count round with its words only. Every other rank raises the reference
    text of every rank's words."""
    recording_world(monkeypatch.setattr)
    world = _world()

    def fn(rank):
        k = recording_kernels(world, rank, [], M, H)
        k.tr.whole_slots = True  # a slot holds stale bytes past a shorter block, as on a GPU
        x, idx, w = _inputs(rank)
        if rank == R - 1 and odd == "rejected":
            words = agreement.rejected("dispatch", 1, BUF, ValueError("topk_idx: expert ids must be < 16"))
            hier_agree.join_rejected(k.comm, words)
            return words, "rejected"
        e = 2 * E if rank == R - 1 else E
        words = agreement.dispatch(1, BUF, x, idx, w, e, None)
        return words, _outcome(lambda: hier_kernels.fresh_counts(k, idx, e, x.shape[0], 1, words))

    out = run(world, fn)
    want = _expected([w for w, _ in out])
    assert want != "ok"
    for rank, (_, got) in enumerate(out):
        if got != "rejected":
            assert got == want, f"rank {rank}"


def test_agreeing_count_round_keeps_the_counts(monkeypatch):
    """With every rank agreeing the count round's words come from the strip and its counts are every rank's."""
    recording_world(monkeypatch.setattr)
    world = _world()

    def fn(rank):
        k = recording_kernels(world, rank, [], M, H)
        x, idx, w = _inputs(rank)
        words = agreement.dispatch(1, BUF, x, idx, w, E, None)
        _, count_matrix, _, counts, _, _ = hier_kernels.fresh_counts(k, idx, E, x.shape[0], 1, words)
        from deepcomm import layout
        mine = layout.token_in_rank(idx, E, R).sum(dim=0).tolist()
        return counts, mine

    out = run(world, fn)
    every = [mine for _, mine in out]
    for counts, _ in out:
        assert counts == every


def _events(monkeypatch):
    """Events that have always run (the recorded launches never run; their copies are made at once on the CPU)."""
    import types
    monkeypatch.setattr(torch.cuda, "Event", lambda: types.SimpleNamespace(
        record=lambda s=None: None, synchronize=lambda: None, query=lambda: True))


def _as_the_kernels_leave_it(world, rank, k, words) -> None:
    """Every rank's ``words`` (gathered from the threads) at its slot of our strip, as a launch with words_at
    leaves it (csrc/kernels/hier_kernels.hpp)."""
    every = world.all_gather(rank, list(words))
    area, at = k.link.area(), hier_agree.strip_at(k.comm)
    for s in range(R):
        o = at + hier_agree.strip_slot(k.comm, s) * RAIL_HEADER_BYTES
        area[o:o + RAIL_HEADER_BYTES] = torch.tensor(every[s], dtype=torch.int32).view(torch.uint8)


def test_cached_dispatch_and_combine_take_the_words_into_the_strip(monkeypatch):
    """A cached dispatch and a combine with words: the launch names the strip (words_at) and, for the combine,
    a header per node GPU; the host then compares the strip: the agreeing cached dispatch passes, the combine
    where rank 3 has no topk_weights raises the reference text on every rank."""
    recording_world(monkeypatch.setattr)
    _events(monkeypatch)
    world = _world()

    def fn(rank):
        launches = []
        k = _with_send_area(recording_kernels(world, rank, launches, M, H))
        x, idx, w = _inputs(rank)
        *_, handle = hier_kernels.dispatch(k, x, idx, w, E, None, 1, agreement.dispatch(1, BUF, x, idx, w, E, None))
        handle.call = 1
        cached = agreement.dispatch(2, BUF, x, None, w, E, handle)
        _as_the_kernels_leave_it(world, rank, k, cached)
        hier_kernels.dispatch(k, x, None, w, E, handle, 1, cached)
        k.synchronize()  # agreed
        recv = sum(handle.count_matrix[:, rank].tolist())
        y, yw = torch.zeros(recv, H, dtype=torch.bfloat16), (None if rank == R - 1 else torch.zeros(recv, K))
        words = agreement.combine(3, BUF, y, handle, yw, False)
        _as_the_kernels_leave_it(world, rank, k, words)
        hier_kernels.combine(k, y, handle, yw, False, words)
        strip = hier_agree.strip_at(k.comm)
        fresh, cached_launch, combine = (launch for _, launch in launches)
        assert fresh.common.words_at == -1  # compared in its count round
        assert cached_launch.common.words_at == strip and cached_launch.common.header_bytes == RAIL_HEADER_BYTES
        assert combine.common.words_at == strip and combine.common.header_bytes == GPN * RAIL_HEADER_BYTES
        return words, _outcome(k.synchronize)

    out = run(world, fn)
    want = _expected([w for w, _ in out])
    assert want.startswith("topk_weights:"), want
    assert [got for _, got in out] == [want] * R


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_a_rejected_cached_dispatch_or_combine_launches_with_no_rows(monkeypatch, op):
    recording_world(monkeypatch.setattr)
    _events(monkeypatch)
    world = _world()

    def fn(rank):
        launches = []
        k = _with_send_area(recording_kernels(world, rank, launches, M, H))
        words = agreement.rejected(op, 4, BUF, ValueError("x: must be bfloat16"))
        k.reject(words, cached=op == "dispatch")
        (kind, launch), = launches
        assert kind == op and launch.common.words_at == hier_agree.strip_at(k.comm)
        assert launch.num_tokens == 0 and launch.rows_from == [0] * NODES and len(k.agreement) == 0
        if op == "dispatch":
            assert launch.rows_to == [0] * NODES
        else:
            assert launch.common.header_bytes == GPN * RAIL_HEADER_BYTES
        # the words went to the front of every section, as a call's do
        heads = k.tr.region[:R * k.tr.slot_bytes].view(R, k.tr.slot_bytes)[:, :RAIL_HEADER_BYTES]
        assert all(h.view(torch.int32).tolist() == list(words) for h in heads)
        return True

    assert all(run(world, fn))
