"""Topology (nodes x GPUs per node): where it comes from, its validation, and the hierarchical combine order the
reference backend adopts for more than one node."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.helpers import bruteforce as bf
from deepcomm.config import Config
from deepcomm.topology import Topology, resolve_topology
from tests.helpers.multiproc import run_ranks


def test_sources_in_order():
    env = {"DEEPCOMM_GPUS_PER_NODE": "2", "LOCAL_WORLD_SIZE": "4"}
    assert resolve_topology(8, 1, env) == Topology(8, 1)           # the argument wins
    assert resolve_topology(8, None, env) == Topology(4, 2)        # then DEEPCOMM_GPUS_PER_NODE
    assert resolve_topology(8, None, {"LOCAL_WORLD_SIZE": "4"}) == Topology(2, 4)  # then torchrun's
    assert resolve_topology(8, None, {}) == Topology(1, 8)         # else one node
    assert resolve_topology(2, None, {"LOCAL_WORLD_SIZE": "8"}) == Topology(1, 2)  # a subgroup inside a node
    assert resolve_topology(2, None, {"DEEPCOMM_GPUS_PER_NODE": " 1 "}) == Topology(2, 1)
    assert resolve_topology(2, None, {"DEEPCOMM_GPUS_PER_NODE": ""}) == Topology(1, 2)


@pytest.mark.parametrize("args, match", [
    ((6, 4, {}), "gpus_per_node: 4 GPUs per node does not divide the 6 ranks"),
    ((6, 0, {}), "gpus_per_node: expected a positive int"),
    ((6, True, {}), "gpus_per_node: expected a positive int"),
    ((6, 2.0, {}), "gpus_per_node: expected a positive int"),
    ((6, None, {"DEEPCOMM_GPUS_PER_NODE": "4"}), "DEEPCOMM_GPUS_PER_NODE: 4 GPUs per node does not divide"),
    ((6, None, {"DEEPCOMM_GPUS_PER_NODE": "two"}), "DEEPCOMM_GPUS_PER_NODE: expected a positive integer"),
    ((6, None, {"DEEPCOMM_GPUS_PER_NODE": "-1"}), "DEEPCOMM_GPUS_PER_NODE: expected a positive integer"),
    ((6, None, {"LOCAL_WORLD_SIZE": "4"}), "LOCAL_WORLD_SIZE: 4 GPUs per node does not divide"),
    ((6, None, {"LOCAL_WORLD_SIZE": "x"}), "LOCAL_WORLD_SIZE: expected a positive integer"),
    ((0, None, {}), "world_size"),
])
def test_bad_sources_name_themselves(args, match):
    with pytest.raises(ValueError, match=match):
        resolve_topology(*args)


def test_rank_numbering():
    t = Topology(3, 4)
    assert (t.world_size, t.is_internode) == (12, True)
    assert [t.node_of(r) for r in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    assert [t.local_index(r) for r in range(12)] == [0, 1, 2, 3] * 3
    assert t.node_ranks(1) == [4, 5, 6, 7]
    assert t.rail_peers(6) == [2, 6, 10]
    assert all(t.rank_of(t.node_of(r), t.local_index(r)) == r for r in range(12))
    assert not Topology(1, 8).is_internode
    for bad in (lambda: t.node_of(12), lambda: t.local_index(-1), lambda: t.rank_of(3, 0), lambda: t.rank_of(0, 4)):
        with pytest.raises(ValueError):
            bad()


def test_config_checks_gpus_per_node():
    assert Config(gpus_per_node=2).gpus_per_node == 2
    with pytest.raises(ValueError, match="gpus_per_node"):
        Config(gpus_per_node=0)


def _gather(obj, world):
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _hierarchical_worker(rank, world, gpus_per_node, via_env, dtype):
    import deepcomm
    if via_env:
        os.environ["DEEPCOMM_GPUS_PER_NODE"] = str(gpus_per_node)
    buf = deepcomm.Buffer(max_tokens_per_rank=64, hidden=256, backend="auto", timeout_s=60,
                          gpus_per_node=None if via_env else gpus_per_node)
    assert buf.topology == Topology(world // gpus_per_node, gpus_per_node)
    assert buf.config.gpus_per_node == gpus_per_node and buf.backend_name == "reference"
    gen = torch.Generator().manual_seed(100 + rank)
    experts = 4 * world
    idx = bf.make_topk(gen, 40 + 3 * rank, 6, experts, p_empty=0.2)
    x = (torch.randn(idx.shape[0], 256, generator=gen) * 1e3).to(dtype)
    recv_x, _, _, _, handle = buf.dispatch(x, topk_idx=idx, num_experts=experts)
    y = (recv_x.double() * torch.randn(recv_x.shape, generator=gen, dtype=torch.float64) * (rank + 1)).to(dtype)
    combined, _ = buf.combine(y, handle)
    xs, idxs, ys = zip(*_gather((x, idx, y), world))
    rows_at = [bf.dispatch(d, xs, idxs, None, experts)[0] for d in range(world)]
    want = bf.combine(rank, ys, rows_at, idxs, experts, dtype, gpus_per_node)
    flat = bf.combine(rank, ys, rows_at, idxs, experts, dtype)
    assert torch.equal(combined.view(torch.uint8), want.view(torch.uint8)), f"rank {rank}: not the hierarchical sum"
    buf.destroy()
    return torch.equal(combined.view(torch.uint8), flat.view(torch.uint8))


def test_two_nodes_of_two_sum_within_node_first():
    """4 ranks as 2 nodes x 2: bit-exact to the hierarchical brute force, and that grouping is not the flat one."""
    same_as_flat = run_ranks(_hierarchical_worker, 4, 2, False, torch.float32)
    assert not all(same_as_flat), "the inputs should tell the two summation orders apart"


def test_one_gpu_per_node_is_the_flat_sum():
    """2 ranks posing as 2 nodes x 1 through DEEPCOMM_GPUS_PER_NODE: identical to the flat rank-ascending sum."""
    assert run_ranks(_hierarchical_worker, 2, 1, True, torch.bfloat16) == [True, True]


def test_bad_env_in_buffer_is_a_value_error():
    assert run_ranks(_bad_env_worker, 2) == [True, True]


def _bad_env_worker(rank, world):
    import deepcomm
    os.environ["DEEPCOMM_GPUS_PER_NODE"] = "3"
    with pytest.raises(ValueError, match="DEEPCOMM_GPUS_PER_NODE: 3 GPUs per node does not divide the 2 ranks"):
        deepcomm.Buffer(max_tokens_per_rank=8, hidden=64, backend="reference")
    return True
