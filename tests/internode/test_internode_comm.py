"""CPU check of the internode backend's hierarchical routing (deepcomm/internode/hier_normal.py over HierComm): the
real routing code runs on gloo with a stand-in transport for the RDMA hop (moves each rank's send blocks into
the peers' receive slots as the NIC round does, and refuses bytes for a rank that is not a rail peer) and a
stand-in NVLink hop (every rank's area is a file mapped shared by the processes of its node; the node barrier is
a process barrier). Results must equal the reference backend bit for bit at 3 x 1, 2 x 2 and 2 x 3 (nodes x
GPUs), and the bytes each hop carried must be exactly the hierarchy's: RDMA only between ranks of the same local
index on different nodes, each token once per remote node, one partial per (token, node) back, NVLink rows at
most once per (token, GPU). The GPU round itself is tested in tests/internode/test_internode.py."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.helpers.multiproc import run_ranks
from tests.helpers.same_bits import assert_same as _same


def up16(n):
    return (n + 15) // 16 * 16


class _StandInTransport:
    """Send area and receive slots in CPU memory; exchange() delivers blocks with all_gather_object. Like
    NicTransport(peers=...), a round carries bytes only to the peers (the rail ranks)."""

    def __init__(self, rank, world, slot_bytes, peers):
        self.rank, self.world, self.slot_bytes, self.peers = rank, world, slot_bytes, set(peers)
        self.send = torch.zeros(world * slot_bytes, dtype=torch.uint8)
        self.recv = torch.zeros(world, slot_bytes, dtype=torch.uint8)
        self.rounds = 0

    def send_view(self, rows, stride):
        return self.send[:rows * stride].view(rows, stride)

    def recv_view(self, src, rows, stride):
        assert src in self.peers, src
        return self.recv[src, :rows * stride].view(rows, stride)

    def recv_rows(self, first, step, count, nbytes):
        return self.recv[first::step][:count, :nbytes]

    def exchange(self, send_bytes, send_begin):
        self.rounds += 1
        for d in range(self.world):
            assert d in self.peers or send_bytes[d] == 0, f"bytes for rank {d}, not a rail peer of {self.rank}"
            assert send_bytes[d] <= self.slot_bytes
        blocks = [bytes(self.send[send_begin[d]:send_begin[d] + send_bytes[d]].numpy().tobytes())
                  if d in self.peers else None for d in range(self.world)]
        everyone = [None] * self.world
        dist.all_gather_object(everyone, blocks)
        self.recv.fill_(0xEE)  # stale bytes must never be read
        for s in self.peers:
            data = everyone[s][self.rank]
            if data:
                self.recv[s, :len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)


class _StandInLink:
    """NodeLink's interface over files mapped shared by the node's processes; fence = a barrier of all ranks
    (every rank makes the same fences). An area is poisoned before every stage: stale rows must never be read."""

    def __init__(self, rank, world, gpus, area_bytes, folder):
        self.gpus, self.local, first = gpus, rank % gpus, rank - rank % gpus
        with open(os.path.join(folder, f"area{rank}"), "wb") as f:
            f.truncate(area_bytes)
        dist.barrier()
        self.areas = [torch.from_file(os.path.join(folder, f"area{first + i}"), shared=True, size=area_bytes,
                                      dtype=torch.uint8) for i in range(gpus)]
        self.fences = 0

    def area(self):
        return self.areas[self.local]

    def put(self, local, byte_offset, rows):
        assert rows.dtype == torch.uint8 and rows.is_contiguous()
        assert 0 <= byte_offset and byte_offset + rows.numel() <= self.areas[local].numel()
        self.areas[local][byte_offset:byte_offset + rows.numel()] = rows.reshape(-1)

    def fence(self, stage):
        if self.gpus == 1:
            return
        if stage.endswith(":free"):
            self.areas[self.local].fill_(0xEE)  # nobody reads our area but us, and we are done with it
        self.fences += 1
        dist.barrier()

    def synchronize(self):
        pass




def _traffic(comm, stage, hop):
    return {peer: n for (st, h, peer), n in comm.traffic.items() if st == stage and h == hop and n}


def _worker(rank, world, G, folder):
    from deepcomm.internode.hier_comm import HierComm
    from deepcomm.internode.hier_normal import dispatch, combine
    from deepcomm.internode.internode_rows import max_node_row_bytes, max_row_bytes
    from deepcomm.fp8 import per_token_cast_to_fp8
    from deepcomm.reference import normal
    from deepcomm.reference.collectives import Comm

    dev = torch.device("cpu")
    N = world // G
    node, local = divmod(rank, G)
    rail = [m * G + local for m in range(N)]
    E, K, M, H = 4 * world, 3, 40, 256
    tr = _StandInTransport(rank, world, M * max_row_bytes(H), [r for r in rail if r != rank])
    link = _StandInLink(rank, world, G, world * M * max_node_row_bytes(H), folder)
    comm = HierComm(tr, link, rank, world, G, dev)
    ref = Comm(None, rank, world, dev, 30.0)
    gen = torch.Generator().manual_seed(5 + rank)
    totals = {"rdma_dispatch_rows": 0, "flat_dispatch_rows": 0, "rdma_combine_multi": 0, "nvl_bytes": 0}
    for T, fp8 in ((0 if rank == 0 else 33, False), (1, True), (M, False), (17, True)):
        what = f"{N}x{G} rank {rank} T={T} {'fp8' if fp8 else 'bf16'}"
        idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
        idx[torch.rand(T, K, generator=gen) < 0.3] = -1
        w = torch.rand(T, K, generator=gen)
        x = (torch.randn(T, H, generator=gen) * 2).to(torch.bfloat16)
        x = per_token_cast_to_fp8(x) if fp8 else x
        x_bytes = H + H // 128 * 4 if fp8 else 2 * H

        comm.traffic.clear()
        a = dispatch(comm, x, idx, w, E, None, 1)
        b = normal.dispatch(ref, x, idx, w, E, None, 1)
        _same(a[:4], b[:4], f"{what}: dispatch outputs")
        for f in ("num_experts", "num_tokens", "hidden", "num_recv", "count_matrix", "recv_src_idx",
                  "is_token_in_rank", "send_pos"):
            _same(getattr(a[4], f), getattr(b[4], f), f"{what}: handle.{f}")
        counts = b[4].count_matrix.tolist()
        owner = torch.where(idx >= 0, idx // (E // world), torch.full_like(idx, world))
        in_rank = torch.zeros(T, world + 1, dtype=torch.bool).scatter_(1, owner, True)[:, :world]
        in_node = in_rank.view(T, N, G).any(dim=2)
        # Everyone's routing, to check what we forward and reduce for the sources of our rail.
        all_in_rank = [None] * world
        dist.all_gather_object(all_in_rank, in_rank)

        # RDMA hop of the payload: each token once to each other node holding any of its experts, to the rank
        # with our local index there; nothing to anyone else.
        stride = up16(x_bytes + 8 * K + 4 + 4 * K + (4 if G > 1 else 0))
        want = {m * G + local: int(in_node[:, m].sum()) * stride for m in range(N) if m != node}
        assert _traffic(comm, "dispatch:rdma", "rdma") == {d: n for d, n in want.items() if n}, what
        totals["rdma_dispatch_rows"] += sum(int(in_node[:, m].sum()) for m in range(N) if m != node)
        totals["flat_dispatch_rows"] += sum(counts[rank][d] for d in range(world) if d // G != node)
        # The count exchange: our row of R (+ N node counts) int32 to each rail peer.
        row = up16(4 * (world + (N if G > 1 else 0)))
        assert _traffic(comm, "dispatch:counts", "rdma") == {d: row for d in rail if d != rank}, what
        # NVLink hop: for every source of our rail, its rows for each GPU of our node, once per (token, GPU).
        nvl = {d: sum(counts[s][d] for s in rail) * stride for d in range(node * G, node * G + G) if d != rank}
        assert _traffic(comm, "dispatch:forward", "nvl") == {d: n for d, n in nvl.items() if n}, what
        assert not _traffic(comm, "dispatch:forward", "rdma") and all(
            h != "rdma" or (p % G == local and p // G != node) for (_, h, p) in comm.traffic), what
        totals["nvl_bytes"] += sum(n for (_, h, _), n in comm.traffic.items() if h == "nvl")

        # Cached re-dispatch: the node counts come from the handle, the node masks travel in the rows.
        x2 = (torch.randn(T, H, generator=gen)).to(torch.bfloat16)
        x2 = per_token_cast_to_fp8(x2) if fp8 else x2
        w2 = torch.rand(T, K, generator=gen)
        comm.traffic.clear()
        _same(dispatch(comm, x2, None, w2, E, a[4], 1)[:4], normal.dispatch(ref, x2, None, w2, E, b[4], 1)[:4],
              f"{what}: cached dispatch")
        stride2 = up16(x_bytes + 4 * K + (4 if G > 1 else 0))
        want = {m * G + local: int(in_node[:, m].sum()) * stride2 for m in range(N) if m != node}
        assert _traffic(comm, "dispatch:rdma", "rdma") == {d: n for d, n in want.items() if n}, what

        n = a[4].num_recv
        y = torch.randn(n, H, generator=gen).to(torch.bfloat16)
        yw = torch.rand(n, K, generator=gen)
        for use_fp8 in (False, True):
            comm.traffic.clear()
            ca = combine(comm, y, a[4], yw, use_fp8)
            cb = normal.combine(ref, y, b[4], yw, use_fp8, G)
            _same(ca, cb, f"{what}: combine fp8={use_fp8}")
            # RDMA hop back: per source s of our rail on another node, one row per token our node holds: as
            # held (bf16 or e4m3 + scales, + weights) with one holder here, fp32 partial with several.
            held_row = up16((H + H // 128 * 4 if use_fp8 else 2 * H) + 4 * K)
            want = {}
            for s in rail:
                if s != rank:
                    holders = all_in_rank[s][:, node * G:node * G + G].sum(dim=1)
                    want[s] = int((holders == 1).sum()) * held_row + int((holders > 1).sum()) * up16(4 * H + 4 * K)
                    totals["rdma_combine_multi"] += int((holders > 1).sum())
            assert _traffic(comm, "combine:rdma", "rdma") == {d: v for d, v in want.items() if v}, what
            # NVLink hop: the rows we hold for source s go to s's forwarder on our node (never our own tokens).
            nvl_stride = up16((H + H // 128 * 4 if use_fp8 else 2 * H) + 4 * K + 4)
            want = {}
            for s in range(world):
                f = node * G + s % G
                if s != rank and f != rank and counts[s][rank]:
                    want[f] = want.get(f, 0) + counts[s][rank] * nvl_stride
            assert _traffic(comm, "combine:gather", "nvl") == want, what
    return tr.rounds, link.fences, totals


def _run(world, G, tmp_path):
    out = run_ranks(_worker, world, G, str(tmp_path))
    rounds = [r for r, _, _ in out]
    assert rounds == [4 * 5] * world  # per case: counts, payload, cached payload, two combines
    return out


def test_hierarchical_matches_reference_3_nodes_x_1(tmp_path):
    out = _run(3, 1, tmp_path)
    assert all(f == 0 and t["nvl_bytes"] == 0 for _, f, t in out)  # no NVLink hop with one GPU per node
    # one GPU per node: a token goes to a node exactly when it goes to its rank
    assert all(t["rdma_dispatch_rows"] == t["flat_dispatch_rows"] for _, _, t in out)


def test_hierarchical_matches_reference_2_nodes_x_2(tmp_path):
    out = _run(4, 2, tmp_path)
    # every stage with an NVLink hop fences twice: counts, payload, cached payload, 2 combines, per case
    assert all(f == 4 * 5 * 2 for _, f, _ in out)
    totals = [t for _, _, t in out]
    # some tokens went to both GPUs of a remote node: one RDMA row instead of two
    assert sum(t["rdma_dispatch_rows"] for t in totals) < sum(t["flat_dispatch_rows"] for t in totals)
    assert sum(t["rdma_combine_multi"] for t in totals) > 0 and sum(t["nvl_bytes"] for t in totals) > 0


def test_hierarchical_matches_reference_2_nodes_x_3(tmp_path):
    out = _run(6, 3, tmp_path)
    totals = [t for _, _, t in out]
    assert sum(t["rdma_dispatch_rows"] for t in totals) < sum(t["flat_dispatch_rows"] for t in totals)
    assert sum(t["rdma_combine_multi"] for t in totals) > 0
