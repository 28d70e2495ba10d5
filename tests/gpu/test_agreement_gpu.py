"""Call fingerprints on GPUs (deepcomm/agreement.py): the reference backend over NCCL, where mismatched collectives
hang instead of aborting, raises ValueError on every rank naming the argument for ranks that disagree about a call
(a rank that rejected its own input, num_experts, hidden, FP8 against BF16, the call order), and the Buffer's next
agreeing call gives the same result as a fresh Buffer's. The CUDA kernels do not compare fingerprints yet."""
from __future__ import annotations

import pytest
import torch

from nccl_run import gpu_count, run_on_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs")]

T, H, E, K, M = 8, 512, 8, 2, 16


def _buffer():
    import deepcomm
    return deepcomm.Buffer(backend="reference", max_tokens_per_rank=M, hidden=H, num_max_low_latency_tokens=M,
                           timeout_s=30.0)


def _inputs(rank, dev, hidden=H):
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(T, hidden, generator=gen).to(torch.bfloat16).to(dev)
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.to(dev)
    return x, idx, torch.rand(T, K, generator=gen).to(dev)


def _step(buf, rank):
    x, idx, w = _inputs(rank, buf.device)
    recv_x, _, recv_w, _, handle = buf.dispatch(x, idx, w, num_experts=E)
    combined, _ = buf.combine(recv_x, handle, recv_w)
    ll_x, _, ll_handle, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    ll_out, _ = buf.low_latency_combine(ll_x, idx, w, ll_handle)
    return [recv_x, combined, ll_out]


def _worker(rank, world):
    from deepcomm.fp8 import per_token_cast_to_fp8
    buf = _buffer()
    fresh = _step(_buffer(), rank)
    me = rank == 1
    x, idx, w = _inputs(rank, buf.device)
    bad = idx.clone()
    if me:
        bad[0, 0] = E
    narrow = _inputs(rank, buf.device, hidden=256 if me else H)
    recv_x, _, recv_w, _, handle = buf.dispatch(x, idx, w, num_experts=E)
    cases = [
        (lambda: buf.dispatch(x, bad, w, num_experts=E),
         "topk_idx: expert ids must be" if me else "topk_idx: rank 1 rejected dispatch call #2"),
        (lambda: buf.dispatch(x, idx, w, num_experts=2 * E if me else E), "num_experts: the value differs"),
        (lambda: buf.dispatch(*narrow, num_experts=E), "x: the hidden size differs"),
        (lambda: buf.dispatch(per_token_cast_to_fp8(x) if me else x, idx, w, num_experts=E), "x: the dtype differs"),
        (lambda: buf.dispatch(x, idx, w, num_experts=E) if me else buf.combine(recv_x, handle, recv_w),
         "call order: "),
        (lambda: buf.low_latency_dispatch(x, idx, M - 1 if me else M, E, use_fp8=False),
         "num_max_dispatch_tokens_per_rank: "),
    ]
    for call, start in cases:
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value).startswith(start), (rank, str(info.value))
    again = _step(buf, rank)
    assert all(torch.equal(a, b) for a, b in zip(again, fresh)), rank


def test_disagreements_raise_on_every_rank_over_nccl():
    run_on_gpus(_worker, 2, timeout_s=180)
