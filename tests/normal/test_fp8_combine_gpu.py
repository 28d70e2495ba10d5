"""FP8 normal combine (use_fp8=True) on the NVLink kernels against the reference backend, bit for bit, on fresh
random inputs: 0 and 1 tokens, -1 slots, a rank with no routed slots, everything to one expert, hidden
2048/4096/7168, num_sms 1/8/24, ugly rows (zero blocks, huge and tiny blocks), back-to-back FP8 and BF16
combines on one handle, a worst-case-sized (num_worst_tokens) input and a CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

from deepcomm.bench.peers import capture_graph
from tests.helpers.nccl_run import cuda_buffer, needs_ranks, rank_device, ranks_for_tests, reference, run_on_gpus, sms

pytestmark = [pytest.mark.gpu,
              needs_ranks(2)]

WORLD = ranks_for_tests()
MAX_TOKENS = 1024

# (tokens per rank by rank, hidden, experts, topk, routing, num_sms)
CASES = [
    ((0, 1), 2048, 16, 2, "random", 1),
    ((1, 0), 4096, 16, 2, "masked", 24),
    ((64, 80), 7168, 256, 8, "random", 24),
    ((128, 128), 7168, 256, 8, "one_expert", 1),
    ((300, 5), 2048, 32, 6, "masked", 24),
    ((40, 40), 7168, 64, 4, "none_on_rank1", 8),
    ((513, 700), 4096, 128, 8, "random", 24),
    ((MAX_TOKENS, MAX_TOKENS), 7168, 256, 8, "random", 24),
]


def _routing(gen, rank, T, E, K, mode, device):
    scores = torch.rand(T, E, generator=gen)
    idx = scores.topk(K, dim=1).indices
    if mode == "masked":
        idx[torch.rand(T, K, generator=gen) < 0.3] = -1
    elif mode == "one_expert":
        idx[:, 0] = 0
        idx[:, 1:] = -1
    elif mode == "none_on_rank1" and rank == 1:
        idx[:] = -1
    return idx.to(device)


def _ugly_rows(gen, n, H, device):
    """Expert outputs in bf16: normal values plus zero blocks, blocks scaled by 1e4 and 1e-6, and rows with one
    large element per block (so the rest falls into e4m3's subnormal range)."""
    y = torch.randn(n, H, generator=gen) * 2
    if n:
        y[::7, :128] = 0.0
        y[1::5, 128:256] *= 1e4
        y[2::5, -128:] *= 1e-6
        y[3::4, ::128] = 300.0
    return y.to(torch.bfloat16).to(device)


def _same(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), f"{what} differs"


def _has_remote_rows(handle, rank):
    other = torch.ones(handle.is_token_in_rank.shape[1], dtype=torch.bool, device=handle.is_token_in_rank.device)
    other[rank] = False
    return bool(handle.is_token_in_rank[:, other].any())


def _worker(rank, world):
    import deepcomm

    dev = rank_device(rank)
    gen = torch.Generator().manual_seed(4321 + rank)
    cuda = cuda_buffer(max_tokens_per_rank=MAX_TOKENS, hidden=7168, num_sms=24, timeout_s=20)
    ref = reference(dev, max_tokens_per_rank=MAX_TOKENS, hidden=7168)
    for case_no, (tokens, H, E, K, mode, num_sms) in enumerate(CASES):
        T = tokens[rank % len(tokens)]  # more ranks than listed: the pattern repeats
        what = f"case {case_no} ({tokens}, H={H}, {mode}, sms={sms(num_sms)})"
        cuda.set_num_sms(sms(num_sms))
        idx = _routing(gen, rank, T, E, K, mode, dev)
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
        hc = cuda.dispatch(x, topk_idx=idx, num_experts=E)[4]
        hr = ref.dispatch(x, topk_idx=idx, num_experts=E)[4]
        _same(hc.count_matrix, hr.count_matrix, f"{what} count_matrix")

        y = _ugly_rows(gen, hc.num_recv, H, dev)
        rw = torch.rand(hc.num_recv, K, generator=gen).to(dev)
        got, got_w = cuda.combine(y, hc, topk_weights=rw, use_fp8=True)
        want, want_w = ref.combine(y, hr, topk_weights=rw, use_fp8=True)
        _same(got, want, f"{what} fp8 combine x")
        _same(got_w, want_w, f"{what} fp8 combine weights")
        exact = cuda.combine(y, hc)[0]
        if _has_remote_rows(hc, rank):
            assert not torch.equal(got, exact), f"{what}: use_fp8 changed nothing though rows crossed ranks"
        else:
            _same(got, exact, f"{what} fp8 combine without remote rows")

        # back to back on one handle, FP8 and BF16 alternating (the staging row stride changes between calls)
        for i in range(4):
            fp8 = i % 2 == 0
            y2 = _ugly_rows(gen, hc.num_recv, H, dev)
            _same(cuda.combine(y2, hc, use_fp8=fp8)[0], ref.combine(y2, hr, use_fp8=fp8)[0],
                  f"{what} repeated combine {i} (fp8={fp8})")

    # worst-case-sized input: rows past the real ones are ignored
    cuda.set_num_sms(sms(24))
    T, H, E, K, W = 200, 4096, 64, 6, WORLD * 256
    idx = _routing(gen, rank, T, E, K, "masked", dev)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
    hc = cuda.dispatch(x, topk_idx=idx, num_experts=E, num_worst_tokens=W)[4]
    hr = ref.dispatch(x, topk_idx=idx, num_experts=E, num_worst_tokens=W)[4]
    assert hc.num_recv == hr.num_recv == W
    y = _ugly_rows(gen, W, H, dev)
    _same(cuda.combine(y, hc, use_fp8=True)[0], ref.combine(y, hr, use_fp8=True)[0], "worst-case fp8 combine")

    # CUDA graph: capture one FP8 combine on a fixed handle, replay with new expert outputs
    hc = cuda.dispatch(x, topk_idx=idx, num_experts=E)[4]
    hr = ref.dispatch(x, topk_idx=idx, num_experts=E)[4]
    ys = _ugly_rows(gen, hc.num_recv, H, dev)
    graph, static_out = capture_graph(lambda: cuda.combine(ys, hc, use_fp8=True))
    for replay in range(3):
        y = _ugly_rows(gen, hc.num_recv, H, dev)
        ys.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        _same(static_out[0], ref.combine(y, hr, use_fp8=True)[0], f"graph replay {replay}")
    cuda.synchronize()
    cuda.destroy()
    ref.destroy()


def test_fp8_combine_matches_reference():
    run_on_gpus(_worker, WORLD)
