"""The hierarchical path's host routing at cluster sizes, on the CPU: 16 nodes x 8 GPUs (128 ranks), and for the
kernels' launch plan also 32 x 8 (256 ranks, the largest topology); every rank a thread of this process
(tests/helpers/threaded_world.py).

- The torch routing of hier_normal.py (the NVSHMEM transport's path) over HierComm, with stand-ins for the RDMA
  hop (rail peers only) and the NVLink hop, against the reference backend's own dispatch and combine code run
  over the same threads: every output row and every handle field bit for bit, fresh, cached, BF16 and FP8.
- The launch plan the dedicated kernels get from hier_kernels.py (the emulated transport's path): a model of
  the dispatch kernel's contract (csrc/kernels/hier_kernels.hpp) driven by that plan must land every rank's rows
  where the reference puts them, and the combine's plan must name, for every (token, node), the place where the
  node partial lands.
"""
from __future__ import annotations

import pytest
import torch

from deepcomm import layout
from deepcomm.internode import hier_kernels
from deepcomm.internode.hier_comm import HierComm
from deepcomm.internode.hier_route import held_slots
from deepcomm.internode.hier_normal import combine, dispatch
from deepcomm.internode.internode_rows import max_node_row_bytes, max_row_bytes
from deepcomm.fp8 import per_token_cast_to_fp8
from deepcomm.reference import normal
from tests.helpers.combine_offsets import recv_offsets
from tests.helpers.threaded_world import NodeArea, RailTransport, ThreadComm, World, run
from tests.helpers.same_bits import assert_same as _same

H, K = 128, 8




def _inputs(rank, world, tokens, experts, node_heavy):
    """Tokens of ``rank``: top-8 of ``experts``, some slots empty; ``node_heavy`` routes most tokens to experts
    of two nodes, so many tokens have several holders on one node (the forwarding's hard case)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    T = tokens if rank % 7 else tokens // 3  # uneven token counts
    if node_heavy:
        per_node = experts // (world // 8)
        nodes = torch.randint(0, world // 8, (T, 2), generator=gen)
        pick = nodes[:, torch.randint(0, 2, (K,), generator=gen)] * per_node + torch.randint(0, per_node, (T, K),
                                                                                            generator=gen)
        idx = pick
    else:
        idx = torch.rand(T, experts, generator=gen).topk(K, dim=1).indices
    idx = torch.where(torch.rand(T, K, generator=gen) < 0.2, torch.full_like(idx, -1), idx)
    w = torch.rand(T, K, generator=gen)
    x = (torch.randn(T, H, generator=gen) * 3).to(torch.bfloat16)
    return idx.contiguous(), w, x


def _hier_worker(world_obj, world, G, tokens, experts):
    def fn(rank):
        tr = RailTransport(world_obj, rank, tokens * max_row_bytes(H), [m * G + rank % G for m in range(world // G)])
        comm = HierComm(tr, NodeArea(world_obj, rank), rank, world, G, torch.device("cpu"))
        ref = ThreadComm(world_obj, rank)
        checked = 0
        for case, (fp8, heavy) in enumerate(((False, False), (True, True))):
            idx, w, x = _inputs(rank + 7919 * case, world, tokens, experts, heavy)
            xin = per_token_cast_to_fp8(x) if fp8 else x
            what = f"{world // G}x{G} rank {rank} case {case}"
            a = dispatch(comm, xin, idx, w, experts, None, 1)
            b = normal.dispatch(ref, xin, idx, w, experts, None, 1)
            _same(a[:4], b[:4], f"{what}: dispatch")
            for f in ("num_recv", "count_matrix", "recv_src_idx", "is_token_in_rank", "send_pos"):
                _same(getattr(a[4], f), getattr(b[4], f), f"{what}: handle.{f}")
            w2 = torch.rand(idx.shape[0], K)
            _same(dispatch(comm, xin, None, w2, experts, a[4], 1)[:4],
                  normal.dispatch(ref, xin, None, w2, experts, b[4], 1)[:4], f"{what}: cached dispatch")
            n = a[4].num_recv
            gen = torch.Generator().manual_seed(rank)
            y = torch.randn(n, H, generator=gen).to(torch.bfloat16)
            yw = torch.rand(n, K, generator=gen)
            _same(combine(comm, y, a[4], yw, fp8), normal.combine(ref, y, b[4], yw, fp8, G), f"{what}: combine")
            checked += n
        # RDMA bytes went to rail peers only (RailTransport refuses others), and to every one of them
        assert set(tr.sent) == tr.peers and all(v > 0 for v in tr.sent.values()), (rank, tr.sent)
        return checked
    return fn


@pytest.mark.parametrize("nodes", [16])  # 32 x 8 passes too, in about 80 s: more than the CPU suite affords
def test_hier_normal_matches_the_reference_at_cluster_size(nodes):
    G, tokens = 8, 24
    world = nodes * G
    experts = 2 * world
    w = World(world, G, area_bytes=world * tokens * max_node_row_bytes(H))
    rows = run(w, _hier_worker(w, world, G, tokens, experts))
    assert sum(rows) > world * tokens  # tokens reached several ranks: the check covered real traffic


# ---- the dedicated kernels' launch plan ----

def _topo(rank, world, G):
    return HierComm(None, None, rank, world, G, torch.device("cpu"))


def _model_dispatch(plans, world, G, stride):
    """The dispatch kernel's contract (hier_kernels.hpp) over every rank's plan: rows are (source rank, token)
    pairs. Returns each rank's area as a list of pairs, route and singles per rank."""
    N = world // G
    sections = {}  # (rank, node m) -> list of (src, token): rank's send section for node m
    for s, p in enumerate(plans):
        for m in range(N):
            rows = [None] * p["rows_to"][m]
            for t in range(p["num_tokens"]):
                slot = int(p["rdma_slot"][t, m])
                if slot >= 0:
                    assert rows[slot] is None, f"rank {s}: two tokens in row {slot} of the section for node {m}"
                    rows[slot] = (s, t, int(p["masks"][t, m]) if G > 1 else 1)
            assert None not in rows, f"rank {s}: rows_to[{m}] names more rows than rdma_slot fills"
            sections[(s, m)] = rows
    areas = [dict() for _ in range(world)]
    routes, singles = [], []
    for r, p in enumerate(plans):
        node, local = divmod(r, G)
        route = torch.full((N, max(p["rows_from"] + [1]), G + 1), -7, dtype=torch.int32)
        single = [0] * N
        for m in range(N):
            src_rank = m * G + local
            rows = sections[(src_rank, node)]  # our own section (m == node) or the block that rank sent us
            assert len(rows) == p["rows_from"][m], f"rank {r}: rows_from[{m}] is not what rank {src_rank} sends"
            per_gpu = [0] * G
            n1 = n2 = 0
            for i, (s, t, mask) in enumerate(rows):
                holders = [g for g in range(G) if mask >> g & 1]
                for g in range(G):
                    if g in holders:
                        at = int(p["first_row"][m][g]) + per_gpu[g]
                        key = node * G + g
                        assert at not in areas[key], f"rank {r} overwrites row {at} of rank {key}"
                        areas[key][at] = (s, t)
                        route[m, i, g] = per_gpu[g]
                        per_gpu[g] += 1
                    else:
                        route[m, i, g] = -1
                if len(holders) == 1:
                    route[m, i, G] = n1
                    n1 += 1
                else:
                    route[m, i, G] = -n2 - 1
                    n2 += 1
            single[m] = n1
        routes.append(route)
        singles.append(single)
    return areas, routes, singles


def _plan_worker(world, G, tokens, experts):
    """Per rank: the dispatch plan hier_kernels builds from the count matrix, and the reference's routing."""
    N = world // G
    from deepcomm import layout
    ins = [_inputs(r, world, tokens, experts, r % 2 == 0) for r in range(world)]
    in_rank = [layout.token_in_rank(idx, experts, world) for idx, _, _ in ins]
    counts = torch.stack([m.sum(dim=0, dtype=torch.int32) for m in in_rank]).tolist()
    ncounts = torch.stack([m.view(-1, N, G).any(dim=2).sum(dim=0, dtype=torch.int32) for m in in_rank]).tolist()
    stride = 16 * 40
    plans = []
    for r in range(world):
        T = in_rank[r].shape[0]
        p = hier_kernels.dispatch_plan(_topo(r, world, G), counts, ncounts, in_rank[r], stride)
        p["num_tokens"] = T
        plans.append(p)
    return in_rank, counts, plans, stride


@pytest.mark.parametrize("nodes", [16, 32])
def test_dispatch_plan_lands_rows_where_the_reference_does(nodes):
    G, tokens = 8, 24
    world = nodes * G
    in_rank, counts, plans, stride = _plan_worker(world, G, tokens, 2 * world)
    areas, routes, singles = _model_dispatch(plans, world, G, stride)
    for d in range(world):
        want = [(s, t) for s in range(world) for t in in_rank[s][:, d].nonzero()[:, 0].tolist()]
        got = [areas[d].get(i) for i in range(len(want))]
        assert got == want, f"rank {d}: rows land out of the reference order"
        assert len(areas[d]) == len(want), f"rank {d}: rows past the {len(want)} it receives"
    # the combine kernel of every rank reads back what the dispatch routed (from the route's held slots)
    for r in range(world):
        topo = _topo(r, world, G)
        recv_off = _route_recv_off(topo.node, world // G, G, in_rank[r], 48, 64)
        N, T = world // G, in_rank[r].shape[0]
        holders = in_rank[r].view(T, N, G).sum(dim=2)
        for m in range(N):
            if m == topo.node:
                continue
            rail = m * G + topo.local
            # the forwarder of node m for us is rank `rail`: its route says where each of our tokens' partial sits
            route = routes[rail][topo.node]
            n1 = singles[rail][topo.node]
            mine = in_rank[r][:, m * G:(m + 1) * G].any(dim=1).nonzero()[:, 0].tolist()
            for i, t in enumerate(mine):
                k = int(route[i, G])
                off = int(recv_off[t, m])
                if k >= 0:
                    assert holders[t, m] == 1 and off == -(k * 48) - 2, (r, m, t, k, off)
                else:
                    assert holders[t, m] > 1 and off == n1 * 48 + (-k - 1) * 64, (r, m, t, k, off)
            absent = set(range(T)) - set(mine)
            assert all(int(recv_off[t, m]) == -1 for t in absent)


def _route_recv_off(node, N, G, in_rank, held_stride, partial_stride):
    """Where the combine kernel reads each token's partial from each node, from the route tables the route kernel's
    oracle makes of ``in_rank`` (hier_route.fill_reference: rdma slots, held slots)."""
    T = in_rank.shape[0]
    if G == 1:  # a node is a rank: its rdma slots and held slots are the send positions
        slots = layout.send_positions(in_rank).to(torch.int32)
        return recv_offsets(slots, slots, None, node, held_stride, partial_stride)
    rdma = hier_kernels._rdma_slots(in_rank.view(T, N, G).any(dim=2))
    held, one_held = held_slots(in_rank, rdma, N, G)
    return recv_offsets(rdma, held, one_held, node, held_stride, partial_stride)


def _recv_off_node_by_node(node, N, G, in_rank, held_stride, partial_stride):
    """The combine's read offsets as its contract reads (hier_kernels.hpp), one node at a time: our own node's tokens
    an fp32 partial each, ranked among the tokens our node holds; another node's a held row (one holder, ranked
    among those) or an fp32 partial after that node's held rows (several holders, ranked among those); -1 none."""
    T = in_rank.shape[0]
    holders = in_rank.view(T, N, G).sum(dim=2).tolist()
    out = torch.full((T, N), -1, dtype=torch.int64)
    for m in range(N):
        col = [h[m] for h in holders]
        if m == node:
            ranked = [t for t in range(T) if col[t] > 0]
            for i, t in enumerate(ranked):
                out[t, m] = i * partial_stride
            continue
        ones = [t for t in range(T) if col[t] == 1]
        many = [t for t in range(T) if col[t] > 1]
        for i, t in enumerate(ones):
            out[t, m] = -(i * held_stride) - 2
        for i, t in enumerate(many):
            out[t, m] = len(ones) * held_stride + i * partial_stride
    return out


@pytest.mark.parametrize("N,G", [(2, 1), (3, 2), (4, 8), (32, 1)])
def test_the_route_tables_give_the_combine_its_contracts_offsets(N, G):
    gen = torch.Generator().manual_seed(N * 10 + G)
    R, T = N * G, 300
    in_rank = torch.rand(T, R, generator=gen) < 0.15
    in_rank[::17] = False  # tokens routed nowhere
    in_rank[5, :] = True  # and one everywhere
    for rank in {0, R - 1, R // 2}:
        node = rank // G
        assert torch.equal(_route_recv_off(node, N, G, in_rank, 48, 80),
                           _recv_off_node_by_node(node, N, G, in_rank, 48, 80)), rank


def test_with_one_gpu_per_node_the_rdma_slots_are_the_send_positions():
    """dispatch_plan takes a fresh dispatch's send positions as its rdma slots at one GPU per node (each node is one
    rank), instead of deriving them again: the same table."""
    from deepcomm import layout
    world, tokens, experts = 16, 40, 64
    gen = torch.Generator().manual_seed(5)
    for r in (0, 7, 15):
        idx = torch.stack([torch.randperm(experts, generator=gen)[:6] for _ in range(tokens)])
        idx[::5, 2] = -1
        in_rank = layout.token_in_rank(idx, experts, world)
        counts = [[0] * world for _ in range(world)]
        derived = hier_kernels.dispatch_plan(_topo(r, world, 1), counts, counts, in_rank, 16)
        send_pos = layout.send_positions(in_rank)
        taken = hier_kernels.dispatch_plan(_topo(r, world, 1), counts, counts, in_rank, 16, send_pos=send_pos)
        assert taken["rdma_slot"] is send_pos and torch.equal(derived["rdma_slot"], send_pos)
        assert derived["rdma_slot"].dtype == send_pos.dtype == torch.int32
        assert taken["first_row"] == derived["first_row"] and taken["masks"] is derived["masks"] is None
