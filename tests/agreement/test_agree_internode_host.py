"""Call agreement of the internode backend's normal mode on the CPU (deepcomm/internode/hier_agree.py): the routing of
hier_normal.py over HierComm, every rank a thread (tests/helpers/threaded_world.py), 3 nodes x 1 GPU, with the
fingerprints Buffer would pass. Where rank 1 disagrees about a call (fresh dispatch, cached dispatch, combine,
another kind of call, a call it rejected) every other rank raises the ValueError of agreement.check over every
rank's words (the reference backend's text), every rank has made the same exchange rounds, and the next agreeing
calls equal the reference backend bit for bit. The same at 2 nodes x 2 GPUs, where the words take both hops (the
rail and the NVLink stage) and the odd rank is also one that shares neither a node nor a rail with rank 0. The
kernels' path (the same words in the header of each rail
block) runs in tests/agreement/test_agree_internode_gpu.py."""
from __future__ import annotations

import pytest
import torch

from deepcomm import agreement
from deepcomm.internode import hier_agree
from deepcomm.internode.hier_comm import HierComm
from deepcomm.internode.hier_normal import combine, dispatch
from deepcomm.internode.internode_rows import max_node_row_bytes, rail_slot_bytes
from deepcomm.reference import normal
from tests.helpers.same_bits import assert_same
from tests.helpers.threaded_world import NodeArea, RailTransport, ThreadComm, World, run

R, E, K, H, M, BUF = 3, 12, 2, 128, 32, 1
REJECTED = "rejected"  # the outcome of the rank that rejected its call (it raises its own error)


def _inputs(rank: int, seed: int, hidden: int = H):
    gen = torch.Generator().manual_seed(100 * seed + rank)
    T = 5 + 3 * rank
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    idx[torch.rand(T, K, generator=gen) < 0.2] = -1
    return (torch.randn(T, hidden, generator=gen).to(torch.bfloat16), idx.contiguous(),
            torch.rand(T, K, generator=gen))


def _outcome(f):
    try:
        f()
        return "ok"
    except ValueError as e:
        return str(e)


def _worker(world: World, odd_rank: int = 1):
    R, G = world.world_size, world.gpus

    def fn(rank: int):
        rail = [r for r in range(R) if r % G == rank % G]
        tr = RailTransport(world, rank, rail_slot_bytes(M, H), rail, whole_slots=True)
        comm = HierComm(tr, NodeArea(world, rank), rank, R, G, torch.device("cpu"))
        ref = ThreadComm(world, rank)
        steps = []  # (this rank's words, outcome) per call
        odd = rank == odd_rank

        def step(words, f):
            steps.append((words, _outcome(f)))

        def reject(op, call, error):
            words = agreement.rejected(op, call, BUF, error)
            hier_agree.join_rejected(comm, words)
            steps.append((words, REJECTED))

        # call 1: an agreeing fresh dispatch, as the reference
        x, idx, w = _inputs(rank, 1)
        words = agreement.dispatch(1, BUF, x, idx, w, E, None)
        out = dispatch(comm, x, idx, w, E, None, 1, fingerprint=words)
        assert_same(out[:4], normal.dispatch(ref, x, idx, w, E, None, 1)[:4], f"rank {rank}: call 1")
        h1 = out[4]
        h1.call = 1
        steps.append((words, "ok"))
        # call 2: num_experts differs on rank 1
        e2 = 2 * E if odd else E
        words = agreement.dispatch(2, BUF, x, idx, w, e2, None)
        step(words, lambda: dispatch(comm, x, idx, w, e2, None, 1, fingerprint=words))
        # call 3: a cached dispatch whose hidden size differs on rank 1
        x3 = _inputs(rank, 3, H // 2 if odd else H)[0]
        words3 = agreement.dispatch(3, BUF, x3, None, w, E, h1)
        step(words3, lambda: dispatch(comm, x3, None, w, E, h1, 1, fingerprint=words3))
        # call 4: a combine with topk_weights on ranks other than 1
        y = torch.randn(h1.num_recv, H).to(torch.bfloat16)
        yw = None if odd else torch.rand(h1.num_recv, K)
        words4 = agreement.combine(4, BUF, y, h1, yw, False)
        step(words4, lambda: combine(comm, y, h1, yw, False, fingerprint=words4))
        # call 5: rank 1 rejected its combine; call 6: its fresh dispatch
        yw = torch.rand(h1.num_recv, K)
        if odd:
            reject("combine", 5, ValueError("topk_weights: expected float32"))
            reject("dispatch", 6, ValueError("topk_idx: expert ids must be < num_experts=12, found 12"))
        else:
            words5 = agreement.combine(5, BUF, y, h1, yw, False)
            step(words5, lambda: combine(comm, y, h1, yw, False, fingerprint=words5))
            words6 = agreement.dispatch(6, BUF, x, idx, w, E, None)
            step(words6, lambda: dispatch(comm, x, idx, w, E, None, 1, fingerprint=words6))
        # call 7: rank 1 makes a cached dispatch, the others a combine; call 8: a fresh dispatch against a combine
        # (with one GPU per node the reference text on every rank; with several a rank may not hear every rank's
        # words: tests/agreement/test_agree_internode_kinds_host.py)
        for call, rank1_call in ((7, "cached"), (8, "fresh")) if G == 1 else ():
            if odd and rank1_call == "cached":
                words = agreement.dispatch(call, BUF, x, None, w, E, h1)
                step(words, lambda: dispatch(comm, x, None, w, E, h1, 1, fingerprint=words))
            elif odd:
                words = agreement.dispatch(call, BUF, x, idx, w, E, None)
                step(words, lambda: dispatch(comm, x, idx, w, E, None, 1, fingerprint=words))
            else:
                words = agreement.combine(call, BUF, y, h1, yw, False)
                step(words, lambda: combine(comm, y, h1, yw, False, fingerprint=words))
        # calls 9-11: agreeing fresh dispatch, cached dispatch and combine, as the reference
        x, idx, w = _inputs(rank, 9)
        words = agreement.dispatch(9, BUF, x, idx, w, E, None)
        out = dispatch(comm, x, idx, w, E, None, 1, fingerprint=words)
        want = normal.dispatch(ref, x, idx, w, E, None, 1)
        assert_same(out[:4], want[:4], f"rank {rank}: call 9")
        h9 = out[4]
        h9.call = 9
        steps.append((words, "ok"))
        x10 = _inputs(rank, 10)[0]
        words = agreement.dispatch(10, BUF, x10, None, w, E, h9)
        assert_same(dispatch(comm, x10, None, w, E, h9, 1, fingerprint=words)[:4],
                    normal.dispatch(ref, x10, None, w, E, want[4], 1)[:4], f"rank {rank}: call 10")
        steps.append((words, "ok"))
        y = torch.randn(h9.num_recv, H).to(torch.bfloat16)
        yw = torch.rand(h9.num_recv, K)
        words = agreement.combine(11, BUF, y, h9, yw, False)
        assert_same(combine(comm, y, h9, yw, False, fingerprint=words), normal.combine(ref, y, want[4], yw, False, 1),
                    f"rank {rank}: call 11")
        steps.append((words, "ok"))
        return steps, tr.rounds
    return fn


def _expected(rows):
    try:
        agreement.check(rows)
    except ValueError as e:
        return str(e)
    return "ok"


def test_internode_ranks_that_disagree_raise_on_every_rank():
    world = World(R, 1, area_bytes=R * M * max_node_row_bytes(H), timeout_s=120.0)
    out = run(world, _worker(world))
    rounds = {r for _, r in out}
    assert len(rounds) == 1, f"ranks made different exchange rounds: {[r for _, r in out]}"
    steps = [s for s, _ in out]
    assert {len(s) for s in steps} == {11}
    raised = []
    for call in range(11):
        rows = [steps[r][call][0] for r in range(R)]
        want = _expected(rows)
        for r in range(R):
            got = steps[r][call][1]
            if got != REJECTED:
                assert got == want, f"call {call + 1}, rank {r}: {got!r} != {want!r}"
        raised.append(want)
    assert raised[0] == "ok" and raised[8:] == ["ok"] * 3
    assert raised[1].startswith("num_experts: the value differs across ranks in dispatch call #2 on this Buffer: "
                                "12 on ranks 0, 2 vs 24 on rank 1")
    assert raised[2].startswith("x: the hidden size differs across ranks in dispatch call #3")
    assert raised[3].startswith("topk_weights: whether it is given differs")
    assert raised[4] == ("topk_weights: rank 1 rejected combine call #5 on this Buffer (see that rank's error); "
                         "no rank ran the call")
    assert raised[5].startswith("topk_idx: rank 1 rejected dispatch call #6")
    assert raised[6].startswith("call order: the ranks are in different calls on this Buffer (combine #7 on ranks "
                                "0, 2 vs dispatch #7 on rank 1)")
    assert raised[7].startswith("call order:")


@pytest.mark.parametrize("odd_rank", [1, 3])
def test_internode_ranks_that_disagree_raise_on_every_rank_at_two_gpus_per_node(odd_rank):
    """2 nodes x 2 GPUs: a fresh dispatch (count exchange), a cached dispatch (rail, then NVLink stage) and a combine
    (NVLink stage, then rail) carry every rank's words to every rank; rank 3 shares neither node nor rail with 0."""
    R2, G2 = 4, 2
    world = World(R2, G2, area_bytes=R2 * M * max_node_row_bytes(H) + hier_agree.strip_bytes(R2), timeout_s=120.0)
    out = run(world, _worker(world, odd_rank))
    assert len({r for _, r in out}) == 1, f"ranks made different exchange rounds: {[r for _, r in out]}"
    steps = [s for s, _ in out]
    assert {len(s) for s in steps} == {9}
    raised = []
    for call in range(9):
        rows = [steps[r][call][0] for r in range(R2)]
        want = _expected(rows)
        for r in range(R2):
            got = steps[r][call][1]
            if got != REJECTED:
                assert got == want, f"call {call + 1}, rank {r}: {got!r} != {want!r}"
        raised.append(want)
    others = ", ".join(str(r) for r in range(R2) if r != odd_rank)
    assert raised[0] == "ok" and raised[6:] == ["ok"] * 3
    assert raised[1].startswith("num_experts: the value differs across ranks in dispatch call #2 on this Buffer: "
                                f"12 on ranks {others} vs 24 on rank {odd_rank}")
    assert raised[2].startswith("x: the hidden size differs across ranks in dispatch call #3")
    assert raised[3].startswith("topk_weights: whether it is given differs")
    assert raised[4] == (f"topk_weights: rank {odd_rank} rejected combine call #5 on this Buffer (see that rank's "
                         "error); no rank ran the call")
    assert raised[5].startswith(f"topk_idx: rank {odd_rank} rejected dispatch call #6")


@pytest.mark.parametrize("fresh", [True, False])
def test_a_call_without_words_pairs_with_nothing_extra(fresh):
    """Without fingerprints the exchanges are the ones they always were: no header, no extra round."""
    world = World(2, 1, area_bytes=2 * M * max_node_row_bytes(H), timeout_s=60.0)

    def fn(rank):
        tr = RailTransport(world, rank, rail_slot_bytes(M, H), range(2))
        comm = HierComm(tr, NodeArea(world, rank), rank, 2, 1, torch.device("cpu"))
        x, idx, w = _inputs(rank, 4)
        E2 = 8
        idx = idx.clamp(max=E2 - 1)
        out = dispatch(comm, x, idx, w, E2, None, 1)
        if not fresh:
            dispatch(comm, x, None, w, E2, out[4], 1)
        return tr.rounds, dict(tr.sent)

    out = run(world, fn)
    assert [r for r, _ in out] == [2 if fresh else 3] * 2
