"""The drop-in pieces on 2 GPUs (CUDA backend when built): the DeepEP compat layer with real CUDA events, and the
MoE layer's forward and backward (bf16) against the dense computation in fp32."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.nccl_run import gpu_count, needs_ranks, rank_device, ranks_for_tests, run_on_gpus, sms

pytestmark = [pytest.mark.gpu]
needs_two = needs_ranks(2)


def _compat_worker(rank, world):
    """DeepEP V1 user code on the CUDA backend: layout, fresh / route-only / cached dispatch with DeepEP's handle
    tuple, combine with events, and low-latency mode with its (src_info, layout_range, ...) handle."""
    import torch.distributed as dist
    from deepcomm.compat import install_deep_ep
    deep_ep = install_deep_ep()
    from deep_ep.utils import EventOverlap
    device = rank_device(rank)
    # calls without a config take DeepEP's default (Buffer.num_sms, 20): within this rank's share of a shared GPU,
    # as a DeepEP user sizes it with Buffer.set_num_sms
    deep_ep.Buffer.set_num_sms(max(2, sms(20) // 2 * 2))
    E, H, T, K = 8 * world, 7168, 1024 + 128 * rank, 8
    gen = torch.Generator().manual_seed(rank)
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.to(device)
    w = torch.rand(T, K, generator=gen).to(device)
    x = torch.randn(T, H, generator=gen).to(device=device, dtype=torch.bfloat16)
    # low-latency calls need DeepEP's low-latency buffer too (low_latency_mode and its RDMA bytes), as in DeepEP
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(128, H, world, E)
    buf = deep_ep.Buffer(dist.group.WORLD, int(1e9), rdma, low_latency_mode=True, max_tokens_per_rank=2048, hidden=H,
                         backend="cuda")
    dc = buf.runtime
    assert dc.backend_name == "cuda"
    per_rank, _, per_expert, in_rank, event = buf.get_dispatch_layout(idx, E, async_finish=True)
    assert isinstance(event, EventOverlap)
    out = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=idx, topk_weights=w, previous_event=event, async_finish=True,
                       config=deep_ep.Config(sms(16)))
    out[5].current_stream_wait()
    want = dc.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]) and out[3] == want[3]
    handle = out[4]
    assert isinstance(handle, tuple) and len(handle) == 6
    assert torch.equal(handle[0], want[4].count_matrix.cumsum(0, dtype=torch.int32))
    assert torch.equal(handle[3], want[4].recv_src_idx) and torch.equal(handle[4], in_rank)
    assert int(handle[0][-1, rank]) == out[0].shape[0]
    # route-only: no top-k, same rows, DeepEP's counts
    ro = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    assert torch.equal(ro[0], want[0]) and ro[1] is None and ro[2] is None and ro[3] == want[3]
    y = (out[0].float() * 0.5).to(torch.bfloat16)
    combined, _, ev = buf.combine(y, handle, async_finish=True)
    with ev:
        pass
    assert torch.equal(combined, dc.combine(y, want[4])[0])
    assert torch.equal(buf.combine(y, ro[4])[0], combined)
    cached = buf.dispatch(x, handle=tuple(handle))
    assert torch.equal(cached[0], want[0])
    # low-latency mode
    M = 128
    xs = x[:M].contiguous()
    ll_idx = idx[:M].contiguous()
    recv, count, ll_handle, _, hook = buf.low_latency_dispatch(xs, ll_idx, M, E, use_fp8=False,
                                                               return_recv_hook=True)
    hook()
    assert isinstance(ll_handle, tuple) and ll_handle[2:] == (M, H, E)
    lr = ll_handle[1]
    assert torch.equal((lr & 0xFFFFFFFF).sum(dim=1).to(torch.int32), count)
    recv = recv.clone()
    got_c = buf.low_latency_combine(recv, ll_idx, w[:M].contiguous(), ll_handle)[0].clone()
    want_ll = dc.low_latency_dispatch(xs, ll_idx, M, E, use_fp8=False)
    for e in range(E // world):
        n = int(count[e])
        assert torch.equal(recv[e, :n], want_ll[0][e, :n])
    assert torch.equal(got_c, dc.low_latency_combine(recv, ll_idx, w[:M].contiguous(), want_ll[2])[0])
    torch.cuda.synchronize()
    buf.destroy()


@needs_two
def test_deep_ep_compat_on_gpus():
    run_on_gpus(_compat_worker, ranks_for_tests())


@pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")
def test_deep_ep_compat_on_one_gpu():
    run_on_gpus(_compat_worker, 1)


def _moe_worker(rank, world):
    import torch.distributed as dist
    import deepcomm
    from deepcomm.moe import MoELayer, dense_moe
    device = rank_device(rank)
    H, F, E, K, T = 256, 512, 8, 2, 384
    gen = torch.Generator().manual_seed(123)
    router = torch.randn(E, H, generator=gen).to(device)
    w1 = (torch.randn(E, H, 2 * F, generator=gen) / H ** 0.5).to(device)
    w2 = (torch.randn(E, F, H, generator=gen) / F ** 0.5).to(device)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank)).to(device)
    buf = deepcomm.Buffer(max_tokens_per_rank=T, hidden=H, backend="cuda")
    layer = MoELayer(buf, H, F, E, K)                      # bf16 on the CUDA backend
    with torch.no_grad():
        layer.router.weight.copy_(router)
    layer.load_global_experts(w1, w2)
    xb = x.to(layer.w_down.dtype).requires_grad_()
    y = layer(xb)
    y.float().square().sum().backward()
    # dense reference in fp32 on the same bf16-rounded parameters
    want = dense_moe(xb.detach().float(), layer.router.weight.detach().float(), w1.bfloat16().float(),
                     w2.bfloat16().float(), K)
    err = (y.float() - want).norm() / want.norm()
    assert err < 3e-2, f"relative error {err:.3e}"
    assert xb.grad is not None and torch.isfinite(xb.grad.float()).all()
    assert layer.w_gate_up.grad is not None and layer.router.weight.grad is not None
    # inference: the Buffer's calls without autograd (deepcomm/eager_ops.py), the same forward
    with torch.no_grad():
        y_inf = layer(xb)
    assert not y_inf.requires_grad
    err = (y_inf.float() - want).norm() / want.norm()
    assert err < 3e-2, f"relative error without gradients {err:.3e}"
    dist.barrier()
    buf.destroy()


@needs_two
def test_moe_layer_on_gpus():
    run_on_gpus(_moe_worker, 2)
