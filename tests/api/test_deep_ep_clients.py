"""DeepEP V1 client code (tests/api/deep_ep_clients.py) through ``import deep_ep`` after ``install_deep_ep()``, on
the CPU reference backend in 2 and 3 gloo processes."""
import pytest
import torch.distributed as dist

from tests.api import deep_ep_clients as clients
from tests.helpers.multiproc import run_ranks

CPU = {"backend": "reference"}


def _deep_ep():
    from deepcomm.compat import install_deep_ep
    install_deep_ep()
    import deep_ep
    return deep_ep


def _intranode(rank, world):
    deep_ep = _deep_ep()
    group = dist.new_group(list(range(world)))
    buffer = clients.deep_ep_test_buffer(deep_ep, group, "normal", **CPU)
    tried = clients.intranode_flow(deep_ep, buffer, group, "cpu")
    buffer.destroy()
    dist.barrier()
    return tried


def _normal_then_low_latency(rank, world):
    # DeepEP's intranode test, low-latency compatibility on: one buffer for both modes, cleaned in between
    deep_ep = _deep_ep()
    group = dist.new_group(list(range(world)))
    buffer = clients.deep_ep_test_buffer(deep_ep, group, "both", **CPU)
    clients.intranode_flow(deep_ep, buffer, group, "cpu", num_tokens=12)
    buffer.clean_low_latency_buffer(16, 512, 4 * world)
    checked = clients.low_latency_flow(deep_ep, buffer, group, "cpu", seed=1,
                                       formats=[(True, False, False), (True, True, True)])
    buffer.destroy()
    return checked


def _low_latency(rank, world):
    deep_ep = _deep_ep()
    group = dist.new_group(list(range(world)))
    buffer = clients.deep_ep_test_buffer(deep_ep, group, "low_latency", **CPU)
    checked = clients.low_latency_flow(deep_ep, buffer, group, "cpu", seed=1)
    buffer.destroy()
    return checked


def _training(rank, world):
    deep_ep = _deep_ep()
    group = dist.new_group(list(range(world)))
    for async_finish in (False, True):
        clients.training_step(deep_ep, group, "cpu", async_finish, extra=CPU)
    return True


def _inference(rank, world):
    deep_ep = _deep_ep()
    group = dist.new_group(list(range(world)))
    for hook in (False, True):
        clients.inference_decode_step(deep_ep, group, "cpu", hook, extra=CPU)
    for columns in (1, 4):
        clients.fp8_prefill_step(deep_ep, group, "cpu", columns, extra=CPU)
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_deep_ep_intranode_flow(world):
    assert run_ranks(_intranode, world, timeout=300) == [24] * world


def test_deep_ep_normal_buffer_reused_for_low_latency():
    assert run_ranks(_normal_then_low_latency, 2, timeout=300) == [4, 4]


@pytest.mark.parametrize("world", [2, 3])
def test_deep_ep_low_latency_flow(world):
    assert run_ranks(_low_latency, world, timeout=300) == [8] * world


def test_training_framework_autograd_pattern():
    assert run_ranks(_training, 2, timeout=300) == [True, True]


def test_inference_engine_patterns():
    assert run_ranks(_inference, 2, timeout=300) == [True, True]
