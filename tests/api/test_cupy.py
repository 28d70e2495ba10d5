"""deepcomm.cupy_ops on CuPy arrays against the torch API, on 2 GPUs (CUDA backend when built)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.helpers.nccl_run import needs_ranks, rank_device, ranks_for_tests, run_on_gpus

pytestmark = [pytest.mark.gpu,
              needs_ranks(2),
              pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="cupy is not installed")]


def _worker(rank, world):
    import cupy
    import deepcomm
    from deepcomm import cupy_ops
    device = rank_device(rank)
    E, H, T, K = 8 * world, 7168, 512 + 64 * rank, 8
    gen = torch.Generator().manual_seed(5 + rank)
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.to(device)
    w = torch.rand(T, K, generator=gen).to(device)
    x = torch.randn(T, H, generator=gen).to(device=device, dtype=torch.bfloat16)
    buf = deepcomm.Buffer(max_tokens_per_rank=1024, hidden=H, backend="cuda")

    x_cp = cupy.from_dlpack(x.view(torch.uint16))      # bf16 bits as uint16
    got = cupy_ops.dispatch(buf, x_cp, cupy.from_dlpack(idx), cupy.from_dlpack(w), E)
    want = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    assert isinstance(got[0], cupy.ndarray)
    # zero copy both ways: the input is x's memory; on the CUDA backend recv_x lies in the arena peers wrote into
    assert x_cp.data.ptr == x.data_ptr()
    arena = getattr(getattr(buf, "_backend", None), "arena", None)
    if arena is not None:
        assert arena.base_ptr <= got[0].data.ptr < arena.base_ptr + arena.nbytes
    assert torch.equal(torch.from_dlpack(got[0]).view(torch.bfloat16), want[0])
    assert torch.equal(torch.from_dlpack(got[1]), want[1]) and torch.equal(torch.from_dlpack(got[2]), want[2])
    assert got[3] == want[3]

    y = (want[0].float() * 0.5).to(torch.bfloat16)
    cx, _ = cupy_ops.combine(buf, cupy.from_dlpack(y.view(torch.uint16)), got[4])
    wx, _ = buf.combine(y, want[4])
    assert isinstance(cx, cupy.ndarray)
    assert torch.equal(torch.from_dlpack(cx).view(torch.bfloat16), wx)
    torch.cuda.synchronize()
    buf.destroy()


def test_cupy_matches_torch_api():
    run_on_gpus(_worker, ranks_for_tests())
