"""DeepEP V1 client code (tests/api/deep_ep_clients.py) on GPUs: the CUDA backend under ``import deep_ep``, with
real CUDA events, and a Buffer built on a gloo group as inference engines build theirs."""
from __future__ import annotations

import pytest

from tests.api import deep_ep_clients as clients
from tests.helpers.nccl_run import needs_ranks, rank_device, ranks_for_tests, run_on_gpus, scaled, sms

pytestmark = [pytest.mark.gpu]


def _deep_ep():
    from deepcomm.compat import install_deep_ep
    install_deep_ep()
    import deep_ep
    return deep_ep


def _client_worker(rank, world):
    import torch
    import torch.distributed as dist
    deep_ep = _deep_ep()
    device = rank_device(rank)
    num_sms = max(2, sms(24) // 2 * 2)
    deep_ep.Buffer.set_num_sms(num_sms)
    group = dist.new_group(list(range(world)))
    buffer = clients.deep_ep_test_buffer(deep_ep, group, "both", num_tokens=16, hidden=512)
    assert buffer.runtime.backend_name == "cuda"
    clients.intranode_flow(deep_ep, buffer, group, device, num_tokens=64, hidden=512, num_sms=num_sms)
    buffer.clean_low_latency_buffer(16, 512, 4 * world)
    clients.low_latency_flow(deep_ep, buffer, group, device, seed=1)
    torch.cuda.synchronize()
    buffer.destroy()

    # an inference engine hands DeepEP its gloo (CPU) group: the Buffer still runs on this GPU, on the CUDA backend
    cpu_group = dist.new_group(list(range(world)), backend="gloo")
    clients.inference_decode_step(deep_ep, cpu_group, device, True)
    clients.fp8_prefill_step(deep_ep, cpu_group, device, 1)
    clients.training_step(deep_ep, group, device, True)
    torch.cuda.synchronize()
    dist.barrier()


@needs_ranks(2)
def test_deep_ep_clients_on_gpus():
    run_on_gpus(_client_worker, ranks_for_tests(), timeout_s=scaled(600))


def _auto_size_worker(rank, world):
    # a DeepEP user's Buffer (bytes only) on the CUDA backend: grown for hidden and for one rank's token count,
    # every result equal to a Buffer of fixed sizes; handles from before the growth still combine
    import torch
    import torch.distributed as dist
    from deepcomm.compat.deep_ep.sizes import START_HIDDEN, START_TOKENS
    deep_ep = _deep_ep()
    device = rank_device(rank)
    # DeepEP's default 20 SMs exceed a rank's share when 8 ranks share one GPU: sized as a DeepEP user would
    deep_ep.Buffer.set_num_sms(max(2, sms(20) // 2 * 2))
    group = dist.new_group(list(range(world)))
    hidden, num_experts = START_HIDDEN * 2, 4 * world
    cfg = deep_ep.Buffer.get_dispatch_config(world)
    nvl = max(cfg.get_nvl_buffer_size_hint(hidden * 2, world),
              deep_ep.Buffer.get_combine_config(world).get_nvl_buffer_size_hint(hidden * 2, world))
    auto = deep_ep.Buffer(group, nvl, 0)
    fixed = deep_ep.Buffer(group, nvl, 0, max_tokens_per_rank=START_TOKENS * 4, hidden=hidden)
    assert auto.runtime.backend_name == "cuda"
    region = auto.get_local_buffer_tensor(torch.int32, torch.Size([4, 8]), offset=128)
    assert region.device == torch.device(device) and region.shape == (4, 8)
    region.fill_(rank + 1)
    results = []
    for step, tokens in enumerate((16, START_TOKENS * 3 if rank == world - 1 else 5)):
        gen = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(num_experts, generator=gen)[:3] for _ in range(tokens)]).to(device)
        w = torch.rand(tokens, 3, generator=gen).to(device)
        outs = []
        for buf in (auto, fixed):
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
            outs.append(buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                     num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w))
        for a, b in zip(outs[0][:3], outs[1][:3]):
            assert torch.equal(a, b)
        assert outs[0][3] == outs[1][3]
        results.append(outs)
    assert auto.buffer.config.max_tokens_per_rank >= START_TOKENS * 3 and auto.buffer.config.hidden == hidden
    for outs in results:  # the first pair's handle predates the growth
        combined = [buf.combine(o[0], o[4])[0] for buf, o in zip((auto, fixed), outs)]
        assert torch.equal(combined[0], combined[1])
    torch.cuda.synchronize()
    assert bool((auto.get_local_buffer_tensor(torch.int32, torch.Size([4, 8]), offset=128) == rank + 1).all())
    auto.destroy()
    fixed.destroy()
    dist.barrier()


@needs_ranks(2)
def test_deep_ep_automatic_sizing_on_gpus():
    run_on_gpus(_auto_size_worker, ranks_for_tests(), timeout_s=scaled(600))
