"""CPU check of the internode backend's row packing (deepcomm/cuda/internode.py, NicComm): the reference's
normal dispatch and combine run over NicComm with a stand-in transport that moves each rank's send blocks into
the peers' receive slots the way the NIC round does (same offsets, 16-byte row stride, the own block read from
the send area), on gloo; results must equal the plain reference collectives bit for bit. The GPU round itself
is tested in tests/gpu/test_internode.py."""
from __future__ import annotations

import torch
import torch.distributed as dist

from multiproc import run_ranks


class _StandInTransport:
    """Send area and receive slots in CPU memory; exchange() delivers blocks with all_gather_object."""

    def __init__(self, rank, world, slot_bytes):
        self.rank, self.world, self.slot_bytes = rank, world, slot_bytes
        self.send = torch.zeros(world * slot_bytes, dtype=torch.uint8)
        self.recv = torch.zeros(world, slot_bytes, dtype=torch.uint8)
        self.rounds = 0

    def send_view(self, rows, stride):
        return self.send[:rows * stride].view(rows, stride)

    def recv_view(self, src, rows, stride):
        return self.recv[src, :rows * stride].view(rows, stride)

    def exchange(self, send_bytes, send_begin):
        self.rounds += 1
        blocks = [bytes(self.send[send_begin[d]:send_begin[d] + send_bytes[d]].numpy().tobytes())
                  if d != self.rank else None for d in range(self.world)]
        everyone = [None] * self.world
        dist.all_gather_object(everyone, blocks)
        self.recv.fill_(0xEE)  # stale bytes must never be read
        for s in range(self.world):
            if s != self.rank and everyone[s][self.rank]:
                data = everyone[s][self.rank]
                self.recv[s, :len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _worker(rank, world, gpus_per_node):
    from deepcomm.cuda.internode import NicComm, max_row_bytes
    from deepcomm.fp8 import per_token_cast_to_fp8
    from deepcomm.reference import normal
    from deepcomm.reference.collectives import Comm

    dev = torch.device("cpu")
    E, K, M, H = 4 * world, 3, 40, 256
    tr = _StandInTransport(rank, world, M * max_row_bytes(H))
    nic = NicComm(tr, None, rank, world, dev, 30.0)
    ref = Comm(None, rank, world, dev, 30.0)
    gen = torch.Generator().manual_seed(5 + rank)
    for T, fp8 in ((0 if rank == 0 else 33, False), (1, True), (M, False), (17, True)):
        idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
        idx[torch.rand(T, K, generator=gen) < 0.3] = -1
        w = torch.rand(T, K, generator=gen)
        x = (torch.randn(T, H, generator=gen) * 2).to(torch.bfloat16)
        x = per_token_cast_to_fp8(x) if fp8 else x
        a = normal.dispatch(nic, x, idx, w, E, None, 1)
        b = normal.dispatch(ref, x, idx, w, E, None, 1)
        for i in (0, 1, 2):
            u, v = (a[i], b[i]) if isinstance(a[i], tuple) else ((a[i],), (b[i],))
            for p, q in zip(u, v):
                assert torch.equal(p.view(torch.uint8), q.view(torch.uint8)), (T, fp8, i)
        assert a[3] == b[3]
        for f in ("count_matrix", "recv_src_idx", "is_token_in_rank", "send_pos"):
            assert torch.equal(getattr(a[4], f), getattr(b[4], f)), f
        n = a[4].num_recv
        y = torch.randn(n, H, generator=gen).to(torch.bfloat16)
        yw = torch.rand(n, K, generator=gen)
        for use_fp8 in (False, True):
            ca = normal.combine(nic, y, a[4], yw, use_fp8, gpus_per_node)
            cb = normal.combine(ref, y, b[4], yw, use_fp8, gpus_per_node)
            assert torch.equal(ca[0].view(torch.uint8), cb[0].view(torch.uint8)) and torch.equal(ca[1], cb[1])
    return tr.rounds


def test_nic_comm_matches_reference_collectives_3_nodes():
    rounds = run_ranks(_worker, 3, 1)
    assert rounds == [4 * 4] * 3  # per case: counts, payload, two combines


def test_nic_comm_matches_reference_collectives_2x2():
    run_ranks(_worker, 4, 2)
