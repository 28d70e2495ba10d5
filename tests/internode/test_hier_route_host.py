"""A fresh internode dispatch's route workspace (deepcomm/internode/hier_route.py, csrc/runtime/hier_route_layout.hpp)
on the CPU: its layout as the extension gives it (regions apart and aligned, the count row's parts in order), and
the torch oracle the GPU kernel is compared with against the routing's own definitions (deepcomm/layout.py,
hier_normal.node_masks) at 2 x 1 up to 32 x 8 ranks, with -1 slots, repeated experts, no tokens and expert ids
outside [-1, E), which count nowhere and are counted in the row. Then the count round refusing such ids on every
rank, the ranks as threads (tests/helpers/hier_stand_ins.py)."""
from __future__ import annotations

import pytest
import torch

from deepcomm import agreement, layout
from deepcomm._ext import load_extension
from deepcomm.internode import hier_kernels, hier_route
from deepcomm.internode.hier_normal import node_masks

C = load_extension()
pytestmark = pytest.mark.skipif(C is None, reason="deepcomm._C is not built (the layout comes from it)")


def _ids(gen, T, E, K, bad=0):
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices if T else torch.empty(0, K, dtype=torch.int64)
    if T:
        idx[torch.rand(T, K, generator=gen) < 0.3] = -1
        if K > 1:
            idx[::3, 1] = idx[::3, 0]  # one expert named twice: counts once
    flat = idx.view(-1)
    for i in range(bad):  # ids outside [-1, E): below -1, E itself and far past it
        flat[(7 * i) % max(1, flat.numel())] = (-2, E, E + 12345, -(1 << 40))[i % 4]
    return idx.contiguous()


@pytest.mark.parametrize("T,R,G,E", [(0, 4, 2, 8), (37, 16, 8, 64), (5, 6, 3, 12)])
def test_route_work_regions_are_apart_and_aligned(T, R, G, E):
    for words in (False, True):
        lay = C.hier_route_work(T, R, G, E, words)
        N = R // G if G > 1 else 0
        spans = [(lay["send_pos"], T * R), (lay["rdma_slot"], T * N), (lay["masks"], T * N),
                 (lay["held_slot"], T * N), (lay["one_held"], N), (lay["row"], lay["row_width"]),
                 (lay["in_rank"], (T * R + 3) // 4)]
        ends = [a + n for a, n in spans]
        assert all(ends[i] <= spans[i + 1][0] for i in range(len(spans) - 1)) and ends[-1] == lay["total"]
        assert lay["row"] % 4 == 0 and lay["row_width"] % 4 == 0  # whole 16-byte rows for the count round
        assert lay["row_words"] == 0 and lay["row_ranks"] == (agreement.WORDS if words else 0)
        assert lay["row_nodes"] == lay["row_ranks"] + R
        assert lay["row_experts"] == lay["row_nodes"] + (R // G if G > 1 else 0)
        assert lay["row_bad"] == lay["row_experts"] + E and lay["row_width"] > lay["row_bad"]
    for bad in [(1, 3, 2, 6), (1, 4, 2, 6), (1, 4, 2, 0), (-1, 4, 2, 8)]:
        with pytest.raises(ValueError):
            C.hier_route_work(bad[0], bad[1], bad[2], bad[3], False)


def _check_oracle(T, R, G, E, K, bad, seed):
    gen = torch.Generator().manual_seed(seed)
    idx = _ids(gen, T, E, K, bad)
    words = tuple(range(5, 5 + agreement.WORDS)) if seed % 2 else None
    t = hier_route.route(None, idx, E, R, G, words)
    what = f"T={T} R={R} G={G} E={E} K={K} bad={bad}"
    valid = torch.where((idx >= -1) & (idx < E), idx, -1)
    in_rank = layout.token_in_rank(valid, E, R)
    assert t.in_rank.dtype == torch.bool and torch.equal(t.in_rank, in_rank), what
    assert torch.equal(t.send_pos, layout.send_positions(in_rank)), what
    p = t.parts
    row = t.row.tolist()
    assert row[p["row_ranks"]:p["row_ranks"] + R] == in_rank.sum(dim=0).tolist(), what
    assert row[p["row_experts"]:p["row_bad"]] == layout.tokens_per_expert(valid, E).tolist(), what
    n_bad = int(((idx < -1) | (idx >= E)).sum())
    assert row[p["row_bad"]] == n_bad and (n_bad > 0) == (bad > 0), what
    assert row[p["row_bad"] + 1:] == [0] * (p["row_width"] - p["row_bad"] - 1), what
    assert row[:p["row_ranks"]] == (list(words) if words else []), what
    if G == 1:
        assert t.masks is None and t.rdma_slot is t.send_pos, what
        assert hier_route.held_views(t)[0] is t.send_pos and hier_route.held_views(t)[1] is None, what
        assert hier_route.held_pointers(t) == (t.send_pos.data_ptr(), 0), what
        return
    N = R // G
    in_node = in_rank.view(T, N, G).any(dim=2)
    assert torch.equal(t.masks, node_masks(in_rank, N, G)), what
    assert torch.equal(t.rdma_slot, hier_kernels._rdma_slots(in_node)), what
    assert row[p["row_nodes"]:p["row_experts"]] == in_node.sum(dim=0).tolist(), what
    # held slots, token by token: among the tokens node m holds on one GPU, or -(among those on several) - 1
    holders = in_rank.view(T, N, G).sum(dim=2).tolist()
    want = [[-1] * N for _ in range(T)]
    for m in range(N):
        ones = [tok for tok in range(T) if holders[tok][m] == 1]
        many = [tok for tok in range(T) if holders[tok][m] > 1]
        for i, tok in enumerate(ones):
            want[tok][m] = i
        for i, tok in enumerate(many):
            want[tok][m] = -i - 1
    held, one_held = hier_route.held_views(t)
    assert held.tolist() == want, what
    assert one_held.tolist() == [sum(1 for h in holders if h[m] == 1) for m in range(N)], what
    base = t.row.data_ptr() - 4 * p["row"]  # (a view without elements may give 0 as its data_ptr)
    assert hier_route.held_pointers(t) == (base + 4 * p["held_slot"], one_held.data_ptr()), what
    assert T == 0 or held.data_ptr() == base + 4 * p["held_slot"], what


@pytest.mark.parametrize("R,G", [(2, 1), (4, 2), (6, 3), (16, 8), (32, 1), (64, 8), (128, 8), (256, 8), (256, 4)])
def test_oracle_equals_the_routing_definitions(R, G):
    for seed, (T, per_rank, K, bad) in enumerate([(0, 2, 4, 0), (1, 1, 1, 0), (97, 2, 8, 0), (300, 1, 8, 5),
                                                  (64, 4, 32, 3)]):
        E = R * per_rank
        _check_oracle(T, R, G, E, min(K, E), bad, seed)


def test_count_round_refuses_bad_ids_on_every_rank(monkeypatch):
    """Rank 2 passes ids outside [-1, E): after the count round it raises naming how many, every other rank
    naming rank 2; nothing is launched."""
    from tests.helpers.hier_stand_ins import recording_kernels, recording_world
    from tests.helpers.threaded_world import World, run
    from deepcomm.internode.internode_rows import max_node_row_bytes
    recording_world(monkeypatch.setattr)
    nodes, G, E, K, T, M, H = 2, 2, 16, 4, 9, 32, 64
    R = nodes * G
    world = World(R, G, area_bytes=R * M * max_node_row_bytes(H), timeout_s=60.0)

    def fn(rank):
        launches = []
        k = recording_kernels(world, rank, launches, M, H)
        idx = _ids(torch.Generator().manual_seed(rank), T, E, K, bad=3 if rank == 2 else 0)
        x = torch.zeros(T, H, dtype=torch.bfloat16)
        words = agreement.dispatch(1, 1, x, idx, None, E, None)
        try:
            hier_kernels.fresh_counts(k, idx, E, T, 1, words)
        except ValueError as e:
            return str(e), launches
        return None, launches

    for rank, (err, launches) in enumerate(run(world, fn)):
        assert not launches, f"rank {rank} launched"
        want = "topk_idx: 3 expert ids outside [-1, 16)" if rank == 2 else "topk_idx: rank 2 passed expert ids"
        assert err is not None and err.startswith(want), f"rank {rank}: {err}"
