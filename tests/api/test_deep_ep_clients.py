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
    assert not buffer.runtime.is_available()
    dist.barrier()
    return tried


def _internode(rank, world):
    # DeepEP's internode test on one host posing as nodes: one GPU per node
    deep_ep = _deep_ep()
    group = dist.new_group(list(range(world)))
    buffer = deep_ep.Buffer(group, int(2e9), int(1e9), low_latency_mode=False, num_qps_per_rank=12,
                            explicitly_destroy=True, gpus_per_node=1, **CPU)
    assert buffer.num_rdma_ranks == world
    tried = clients.intranode_flow(deep_ep, buffer, group, "cpu", num_tokens=24, gpus_per_node=1)
    buffer.destroy()
    return tried


def _over_the_maximum(rank, world):
    # one rank dispatches more tokens than the Buffer holds: every rank hears of it, that rank is told the keyword
    deep_ep = _deep_ep()
    # DeepEP's buffers hold both calls; deepcomm's are fixed by the keywords
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(1024, 256, world, 4 * world)
    buffer = deep_ep.Buffer(dist.group.WORLD, int(1e9), rdma, low_latency_mode=True, max_tokens_per_rank=16,
                            num_max_low_latency_tokens=512, **CPU)
    num_tokens = 20 if rank == 0 else 4
    x = clients.torch.zeros(num_tokens, 256, dtype=clients.torch.bfloat16)
    idx = clients.torch.zeros(num_tokens, 2, dtype=clients.torch.int64)
    idx[:, 1] = 4 * world - 1
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, 4 * world)
    with pytest.raises(ValueError, match="^x: ") as err:
        buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=idx)
    if rank == 0:
        assert "deep_ep.Buffer(..., max_tokens_per_rank=N)" in str(err.value)
    with pytest.raises(ValueError, match="^num_max_dispatch_tokens_per_rank.*num_max_low_latency_tokens=N"):
        buffer.low_latency_dispatch(x[:4], idx[:4], 1024, 4 * world)
    buffer.destroy()
    return True


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


def test_deep_ep_internode_flow_posed_nodes():
    assert run_ranks(_internode, 2, timeout=300) == [24, 24]


def test_size_limits_name_the_constructor_keyword():
    assert run_ranks(_over_the_maximum, 2, timeout=120) == [True, True]


def test_deep_ep_normal_buffer_reused_for_low_latency():
    assert run_ranks(_normal_then_low_latency, 2, timeout=300) == [4, 4]


@pytest.mark.parametrize("world", [2, 3])
def test_deep_ep_low_latency_flow(world):
    assert run_ranks(_low_latency, world, timeout=300) == [8] * world


def test_training_framework_autograd_pattern():
    assert run_ranks(_training, 2, timeout=300) == [True, True]


def test_inference_engine_patterns():
    assert run_ranks(_inference, 2, timeout=300) == [True, True]
