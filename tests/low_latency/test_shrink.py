"""Masking ranks in low-latency mode (Buffer.mask_ranks) on the reference backend, 3 CPU processes: ranks 0 and 1
go on without rank 2 and rank 2 without them, each result equal to the brute force over the routing with the masked
ranks' experts dropped; unmask_ranks brings every rank back. Plus the argument checks."""
import pytest
import torch

from tests.helpers import bruteforce as bf
from tests.helpers.multiproc import run_ranks
from tests.normal.test_normal import _equal, _gather

M, H, K, PER_RANK = 6, 256, 3, 2


def _drop(idx, gone, num_experts, world):
    owner = idx.clamp(min=0) // (num_experts // world)
    keep = torch.ones_like(idx, dtype=torch.bool)
    for r in gone:
        keep &= owner != r
    return torch.where(keep, idx, torch.full_like(idx, -1))


def _round(buf, rank, world, seed, gone_by_rank):
    experts = PER_RANK * world
    gen = torch.Generator().manual_seed(seed + rank)
    idx = bf.make_topk(gen, 5, K, experts, p_empty=0.1)
    w = torch.rand(idx.shape, generator=gen)
    x = torch.randn(idx.shape[0], H, generator=gen).to(torch.bfloat16)
    xs, idxs, ws = zip(*_gather((x, idx, w), world))
    eff = [_drop(i, gone_by_rank[r], experts, world) for r, i in enumerate(idxs)]
    recv_x, recv_count, handle, _ = buf.low_latency_dispatch(x, idx, M, experts, use_fp8=False)
    want = bf.ll_dispatch(rank, xs, eff, experts, M, False, False)
    assert recv_count.tolist() == [len(e[0]) for e in want], f"rank {rank} recv_count"
    _equal(handle.recv_pos, bf.ll_recv_pos(rank, eff, experts), f"rank {rank} recv_pos")
    for e, (entries, payload, _, _) in enumerate(want):
        _equal(recv_x[e, :len(entries)], payload, f"rank {rank} expert {e}")
    y = (recv_x.float() * 2 + rank).to(torch.bfloat16)
    ys = _gather(y, world)
    out, _ = buf.low_latency_combine(y, idx, w, handle)
    _equal(out, bf.ll_combine(rank, ys, eff, ws, experts), f"rank {rank} combined")


def _worker(rank, world):
    import deepcomm
    buf = deepcomm.Buffer(max_tokens_per_rank=8, hidden=H, num_max_low_latency_tokens=8, timeout_s=60)
    for bad, what in ((2, "an int"), ([world], "out of range"), ([rank], "itself"), (["1"], "not an int")):
        with pytest.raises(ValueError, match="^ranks"):
            buf.mask_ranks(bad)
    assert buf.masked_ranks == []
    gone = {0: {2}, 1: {2}, 2: {0, 1}}
    buf.mask_ranks(sorted(gone[rank]))
    assert buf.masked_ranks == sorted(gone[rank])
    _round(buf, rank, world, 10, gone)
    _round(buf, rank, world, 20, gone)
    buf.unmask_ranks()
    assert buf.masked_ranks == []
    _round(buf, rank, world, 30, {r: set() for r in range(world)})
    buf.destroy()
    return True


def test_masked_ranks_drop_out_of_low_latency_mode():
    assert run_ranks(_worker, 3) == [True] * 3
