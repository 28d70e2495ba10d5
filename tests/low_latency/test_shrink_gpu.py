"""Masking ranks in low-latency mode on the CUDA kernels (Buffer.mask_ranks):

- a live pair where each rank masks the other (more ranks: in pairs, each masking its partner): every result equals the reference backend under the same mask, bit
  for bit; normal mode refuses while ranks are masked; after unmask_ranks (collective) both modes work again;
- a peer killed between calls: the survivor gets CommTimeoutError, masks the lost peer and goes on in low-latency
  mode alone, with results computed here without any peer."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.fault_run import die, run_with_faults
from tests.helpers.nccl_run import cuda_buffer, needs_ranks, ranks_for_tests, reference, run_on_gpus, sms
from tests.low_latency.test_ll_kernels import _check_dispatch

pytestmark = [pytest.mark.gpu, needs_ranks(2)]

T, H, E, K, M = 64, 2048, 32, 4, 64


def _inputs(gen, dev):
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    idx[torch.rand(T, K, generator=gen) < 0.2] = -1
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    w = torch.rand(T, K, generator=gen)
    return x.to(dev), idx.to(dev), w.to(dev)


def _same_as_reference(cuda, ref, gen, what):
    dev, world = cuda.device, cuda.world_size
    for use_fp8 in (False, True):
        x, idx, w = _inputs(gen, dev)
        got = cuda.low_latency_dispatch(x, idx, M, E, use_fp8=use_fp8)
        want = ref.low_latency_dispatch(x, idx, M, E, use_fp8=use_fp8)
        _check_dispatch(got, want, f"{what} fp8={use_fp8}")
        y = torch.randn(E // world, world * M, H, generator=gen).to(torch.bfloat16).to(dev)
        out, _ = cuda.low_latency_combine(y, idx, w, got[2])
        assert torch.equal(out, ref.low_latency_combine(y, idx, w, want[2])[0]), f"{what} combine"


def _pair_worker(rank, world):
    gen = torch.Generator().manual_seed(70 + rank)
    kw = dict(max_tokens_per_rank=T, hidden=H, num_max_low_latency_tokens=M)
    cuda = cuda_buffer(num_sms=8, timeout_s=20, **kw)
    ref = reference(cuda.device, **kw)
    _same_as_reference(cuda, ref, gen, "before masking")
    partner = rank ^ 1  # ranks in pairs (0, 1), (2, 3)...: each masks its partner and goes on with the rest
    for buf in (cuda, ref):
        buf.mask_ranks([partner])
    assert cuda.masked_ranks == [partner]
    for i in range(3):
        _same_as_reference(cuda, ref, gen, f"masked round {i}")
    x, idx, _ = _inputs(gen, cuda.device)
    with pytest.raises(RuntimeError, match="masked"):
        cuda.dispatch(x, topk_idx=idx, num_experts=E)
    for buf in (cuda, ref):
        buf.unmask_ranks()
    for i in range(2):
        _same_as_reference(cuda, ref, gen, f"unmasked round {i}")
    recv_x, _, _, _, handle = cuda.dispatch(x, topk_idx=idx, num_experts=E)
    want_x, _, _, _, want_handle = ref.dispatch(x, topk_idx=idx, num_experts=E)
    assert torch.equal(recv_x, want_x), "normal dispatch after unmask"
    assert torch.equal(cuda.combine(recv_x, handle)[0], ref.combine(want_x, want_handle)[0]), "normal combine"
    cuda.synchronize()
    cuda.destroy()
    ref.destroy()


def test_masked_pair_matches_reference():
    run_on_gpus(_pair_worker, ranks_for_tests(), timeout_s=240)


def _alone_round(buf, gen, use_fp8):
    """Rank 0 without rank 1: only slots naming experts 0..E/2-1 count. Checked without any peer."""
    dev = buf.device
    x, idx, w = _inputs(gen, dev)
    L = E // 2
    mine = (idx >= 0) & (idx < L)
    recv_x, recv_count, handle, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=use_fp8)
    values = recv_x[0] if use_fp8 else recv_x
    ref_x = deepcomm_cast(x, use_fp8)
    for e in range(L):
        tokens = (idx == e).any(dim=1).nonzero()[:, 0]
        assert int(recv_count[e]) == tokens.numel(), f"recv_count of expert {e}"
        assert torch.equal(values[e, :tokens.numel()].view(torch.uint8), ref_x[tokens].view(torch.uint8)), f"expert {e}"
        assert torch.equal(handle.src_info[e, :tokens.numel()], tokens.to(torch.int32)), f"src_info of expert {e}"
    assert torch.equal(handle.recv_pos >= 0, mine), "recv_pos: -1 exactly for slots not kept"
    # combine with the dispatched rows as expert outputs: out = sum over kept slots ascending of w * x, fp32
    y = torch.zeros(L, 2 * M, H, dtype=torch.bfloat16, device=dev)
    for e in range(L):
        y[e, :int(recv_count[e])] = x[handle.src_info[e, :int(recv_count[e])].long()]
    out, _ = buf.low_latency_combine(y, idx, w, handle)
    part = torch.zeros(T, H, device=dev)
    for k in range(K):
        keep = mine[:, k]
        part[keep] = part[keep] + w[keep, k:k + 1] * x[keep].float()
    assert torch.equal(out, part.to(torch.bfloat16)), "combine alone"


def deepcomm_cast(x, use_fp8):
    from deepcomm.fp8 import per_token_cast_to_fp8
    return per_token_cast_to_fp8(x)[0] if use_fp8 else x


def _killed_worker(rank, world):
    import deepcomm
    gen = torch.Generator().manual_seed(90 + rank)
    buf = deepcomm.Buffer(max_tokens_per_rank=T, hidden=H, backend="cuda", num_max_low_latency_tokens=M,
                          num_sms=sms(8), timeout_s=3)
    for _ in range(3):
        x, idx, w = _inputs(gen, buf.device)
        recv_x, _, handle, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        buf.low_latency_combine(recv_x, idx, w, handle)
    torch.cuda.synchronize()
    if rank == 1:
        die()
    x, idx, _ = _inputs(gen, buf.device)
    with pytest.raises(deepcomm.CommTimeoutError) as info:
        buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        buf.synchronize()
    assert info.value.peer == 1, str(info.value)
    buf.mask_ranks([1])  # local: rank 1 is gone
    for i in range(4):
        _alone_round(buf, gen, use_fp8=bool(i % 2))
    with pytest.raises(RuntimeError, match="masked"):
        buf.dispatch(x, topk_idx=idx, num_experts=E)
    buf.synchronize()
    buf.destroy()


def test_killed_peer_masked_and_low_latency_goes_on():
    run_with_faults(_killed_worker, 2, killed=(1,), deadline_s=150)
