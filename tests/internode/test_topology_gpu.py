"""Topology on 2 GPUs: posing as 2 nodes x 1 GPU (argument or DEEPCOMM_GPUS_PER_NODE), which backend a Buffer
gets (the internode CUDA backend for 2 x 1), and the reference's hierarchical combine at 1 GPU per node equal,
bit for bit, to the NVLink kernels."""
from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.nccl_run import needs_ranks, rank_device, reference, run_on_gpus, shared_gpu

pytestmark = [pytest.mark.gpu, needs_ranks(2)]


def _topology_worker(rank, world):
    import deepcomm
    from deepcomm.topology import Topology

    dev = rank_device(rank)
    inter = deepcomm.Buffer(max_tokens_per_rank=64, hidden=2880, backend="cuda", gpus_per_node=1, timeout_s=20)
    assert type(inter._backend).__name__ == "InternodeBackend"  # the emulated-NIC path (tests/internode/test_internode.py)
    inter.destroy()
    os.environ["DEEPCOMM_GPUS_PER_NODE"] = "1"
    auto = deepcomm.Buffer(max_tokens_per_rank=64, hidden=2880, backend="auto", timeout_s=20)
    nodes = reference(dev, max_tokens_per_rank=64, hidden=2880, timeout_s=20)
    del os.environ["DEEPCOMM_GPUS_PER_NODE"]
    # "auto" picks the CUDA backend on an NCCL group; on shared mode's gloo group the reference (docs/api.md)
    assert auto.topology == Topology(2, 1) and auto.backend_name == ("reference" if shared_gpu() else "cuda")
    auto.destroy()
    assert nodes.topology == Topology(2, 1) and nodes.backend_name == "reference"
    flat = deepcomm.Buffer(max_tokens_per_rank=64, hidden=2880, backend="cuda", timeout_s=20)
    assert flat.topology == Topology(1, 2) and flat.backend_name == "cuda"

    gen = torch.Generator().manual_seed(40 + rank)
    E, K, H = 16, 4, 2880
    for T, mode in ((0 if rank == 0 else 37, "random"), (1, "random"), (50, "one_expert"), (64, "masked")):
        idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
        if mode == "one_expert":
            idx[:] = -1
            idx[:, 0] = E - 1
        if mode == "masked":
            idx[torch.rand(T, K, generator=gen) < 0.4] = -1
        idx, w = idx.to(dev), torch.rand(T, K, generator=gen).to(dev)
        x = (torch.randn(T, H, generator=gen) * 3).to(torch.bfloat16).to(dev)
        out_n = nodes.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        out_f = flat.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        assert torch.equal(out_n[0].view(torch.uint8), out_f[0].view(torch.uint8)), f"{mode}: recv_x"
        y = torch.randn(out_n[4].num_recv, H, generator=gen).to(torch.bfloat16).to(dev)
        yw = torch.rand(out_n[4].num_recv, K, generator=gen).to(dev)
        comb_n = nodes.combine(y, out_n[4], topk_weights=yw)
        comb_f = flat.combine(y, out_f[4], topk_weights=yw)
        assert torch.equal(comb_n[0].view(torch.uint8), comb_f[0].view(torch.uint8)), f"{mode}: combined x"
        assert torch.equal(comb_n[1], comb_f[1]), f"{mode}: combined weights"
    flat.destroy()
    nodes.destroy()


def test_two_nodes_of_one_gpu():
    run_on_gpus(_topology_worker, 2)
