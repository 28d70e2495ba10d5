"""torch.compile(fullgraph=True) through deepcomm's operators on the CUDA backend (bf16), against eager.

dispatch + combine (forward and backward; aot_eager and inductor), the num_worst_tokens form and the low-latency
calls: bit for bit. The MoE layer: bit for bit with aot_eager but for x.grad (one bf16 unit of its largest value:
the sum of its paths is rounded at different points), within bf16 rounding with inductor (its fused kernels
round differently).
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.nccl_run import needs_ranks, rank_device, ranks_for_tests, run_on_gpus, scaled

WORLD = ranks_for_tests()
pytestmark = [pytest.mark.gpu, needs_ranks(WORLD)]
HIDDEN, EXPERTS, TOPK = 2048, 32, 4


def _settings(data_dependent: bool) -> None:
    torch._dynamo.config.capture_dynamic_output_shape_ops = data_dependent
    torch._dynamo.config.capture_scalar_outputs = data_dependent


def _inputs(rank, dev, tokens=None):
    gen = torch.Generator().manual_seed(100 + rank)
    T = tokens if tokens is not None else 64 + 37 * rank
    idx = torch.rand(T, EXPERTS, generator=gen).topk(TOPK, dim=1).indices
    idx[torch.rand(T, TOPK, generator=gen) < 0.2] = -1
    x = torch.randn(T, HIDDEN, generator=gen).to(torch.bfloat16)
    w = torch.rand(T, TOPK, generator=gen)
    return x.to(dev), idx.to(dev), w.to(dev)


def _same(want, got, what):
    for i, (a, b) in enumerate(zip(want, got)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}[{i}]: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        if not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
            diff = (a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).nonzero()
            flat_a, flat_b = a.reshape(-1), b.reshape(-1)
            first = [int(j) for j in (a != b).reshape(-1).nonzero()[:8, 0]] if a.numel() else []
            raise AssertionError(f"{what}[{i}] differs: {diff.shape[0]} bytes of {a.numel() * a.element_size()}; "
                                 f"first elements {first}: eager {[flat_a[j].item() for j in first]}, compiled "
                                 f"{[flat_b[j].item() for j in first]}")


def _run(step, x, idx, w):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    outs = step(x, idx, w)
    g = torch.Generator(device=x.device).manual_seed(5)
    loss = (outs[0].float() * torch.randn(outs[0].shape, generator=g, device=x.device)).sum() + outs[1].sum()
    loss.backward()
    return [o.detach().clone() for o in outs] + [x.grad, w.grad]


def _normal_worker(rank, world):
    import deepcomm
    _settings(True)
    dev = rank_device(rank)
    buf = deepcomm.Buffer(max_tokens_per_rank=512, hidden=HIDDEN, backend="cuda", timeout_s=30)

    def step(x, idx, w):
        recv_x, _, recv_w, _, handle = deepcomm.ops.dispatch(buf, x, idx, w, num_experts=EXPERTS)
        out, combined_w = deepcomm.ops.combine(buf, recv_x * 2.0, handle, topk_weights=recv_w)
        return out, combined_w, recv_x, handle.recv_src_idx

    def worst_step(x, idx, w):
        recv_x, _, recv_w, counts, handle = deepcomm.ops.dispatch(buf, x, idx, w, num_experts=EXPERTS,
                                                                  num_worst_tokens=world * 512)
        out, combined_w = deepcomm.ops.combine(buf, recv_x * 2.0, handle, topk_weights=recv_w)
        return out, combined_w, counts

    for backend in ("aot_eager", "inductor"):
        compiled = torch.compile(step, fullgraph=True, backend=backend)
        for tokens in (None, 5 + rank):
            inputs = _inputs(rank, dev, tokens)
            _same(_run(step, *inputs), _run(compiled, *inputs), f"{backend}, {tokens} tokens, rank {rank}")
        compiled = torch.compile(worst_step, fullgraph=True, backend=backend)
        inputs = _inputs(rank, dev)
        _same(_run(worst_step, *inputs), _run(compiled, *inputs), f"{backend} num_worst_tokens, rank {rank}")
    buf.destroy()


def test_compiled_dispatch_combine_cuda():
    run_on_gpus(_normal_worker, WORLD, timeout_s=scaled(900))


def _worst_counts_worker(rank, world):
    import torch.distributed as dist

    import deepcomm
    from tests.helpers import worst_counts
    _settings(True)  # as _normal_worker, where the compiled worst-case counts were seen to differ
    dev = rank_device(rank)
    buf = deepcomm.Buffer(max_tokens_per_rank=512, hidden=HIDDEN, backend="cuda", timeout_s=30)
    x, idx, w = _inputs(rank, dev)
    rows = worst_counts.run_steps(rank, world, buf, x, idx, w, EXPERTS, world * 512)
    # the same again after fresh data-dependent calls, eager and compiled (the order of _normal_worker)
    worst_counts.normal_calls(buf, x, idx, w, EXPERTS)
    rows += worst_counts.run_steps(rank, world, buf, x, idx, w, EXPERTS, world * 512, "after fresh calls: ")
    buf.destroy()
    every = [None] * world
    dist.all_gather_object(every, rows)  # every rank's table in the one message the runner shows
    bad = worst_counts.failures([r for per_rank in every for r in per_rank])
    assert not bad, "worst-case per-expert counts differ from the host's:\n" + "\n".join(bad)


def test_worst_case_counts_match_host_counts_cuda():
    """Each worst-case dispatch's per-expert counts (eager, compiled, compiled without grad, in one sequence; then
    again after fresh dispatches) equal the counts worked out on the host (tests/helpers/worst_counts.py)."""
    run_on_gpus(_worst_counts_worker, WORLD, timeout_s=scaled(600))


def _moe_worker(rank, world):
    import deepcomm
    from deepcomm.moe import MoELayer
    _settings(True)
    dev = rank_device(rank)
    buf = deepcomm.Buffer(max_tokens_per_rank=512, hidden=HIDDEN, backend="cuda", timeout_s=30)
    torch.manual_seed(7)
    layer = MoELayer(buf, HIDDEN, 1024, EXPERTS, TOPK, expert_alignment=16)  # bf16 on the CUDA backend
    x = _inputs(rank, dev)[0]

    def run(fn):
        layer.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        y = fn(leaf)
        y.float().square().sum().backward()
        return [y.detach(), leaf.grad] + [p.grad.clone() for p in layer.parameters()]

    want = run(layer)
    got = run(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    # x feeds the router and the dispatch: its gradient is a sum of bf16 gradients of several paths, which eager
    # autograd and the compiled backward add in other orders, so a partial sum is rounded at another magnitude:
    # one bf16 unit of the largest gradient at most (measured: 2^-10 where x.grad is 0.075 and the largest is
    # 0.258); all else bit-exact
    a, b = want[1].float(), got[1].float()
    err = (a - b).abs()
    assert bool((err <= a.abs() * 2 ** -7 + a.abs().max() * 2 ** -8).all()), (
        f"MoE aot_eager, rank {rank}: x.grad off by more than one bf16 unit (max error {err.max().item()} where "
        f"|x.grad| is {a.reshape(-1)[err.argmax()].abs().item()}; largest |x.grad| {a.abs().max().item()})")
    _same(want[:1] + want[2:], got[:1] + got[2:], f"MoE aot_eager (all but x.grad), rank {rank}")
    for i, (a, b) in enumerate(zip(want, run(torch.compile(layer, fullgraph=True)))):
        err, scale = (a.float() - b.float()).abs().max().item(), a.float().abs().max().item()
        assert err <= 3e-2 * scale, f"MoE inductor [{i}], rank {rank}: max error {err} of {scale}"
    buf.destroy()


def test_compiled_moe_layer_cuda():
    run_on_gpus(_moe_worker, WORLD, timeout_s=scaled(900))


def _low_latency_worker(rank, world):
    import deepcomm
    _settings(False)  # static shapes
    dev = rank_device(rank)
    M = 64
    buf = deepcomm.Buffer(max_tokens_per_rank=512, hidden=HIDDEN, backend="cuda", num_max_low_latency_tokens=M,
                          timeout_s=30)
    gen = torch.Generator().manual_seed(200 + rank)
    T = 40 + rank
    idx = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(T)]).to(dev)
    x = torch.randn(T, HIDDEN, generator=gen).to(torch.bfloat16).to(dev)
    w = torch.rand(T, TOPK, generator=gen).to(dev)

    def step(x, idx, w, use_fp8):
        recv_x, recv_count, handle = deepcomm.ops.low_latency_dispatch(buf, x, idx, M, EXPERTS, use_fp8=use_fp8)
        values = deepcomm.fp8.per_token_cast_back(*recv_x).to(torch.bfloat16) if use_fp8 else recv_x
        out = deepcomm.ops.low_latency_combine(buf, values * 2.0, idx, w, handle)
        return out, recv_count

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    for use_fp8 in (False, True):
        want = [t.clone() for t in step(x, idx, w, use_fp8)]
        _same(want, [t.clone() for t in compiled(x, idx, w, use_fp8)], f"low latency fp8={use_fp8}, rank {rank}")
    buf.destroy()


def test_compiled_low_latency_cuda():
    run_on_gpus(_low_latency_worker, WORLD, timeout_s=scaled(900))
