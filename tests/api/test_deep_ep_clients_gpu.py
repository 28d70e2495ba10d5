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
