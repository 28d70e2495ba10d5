"""deepcomm.cupy_ops on the CPU: the DLPack conversion helpers and the functional API on NumPy arrays
(the same code path CuPy arrays take on GPUs), in 2 gloo processes on the reference backend."""
import numpy as np
import pytest
import torch

from tests.helpers import bruteforce as bf
from tests.helpers.multiproc import run_ranks


def test_conversions_share_memory():
    from deepcomm.cupy_ops import from_torch, to_torch
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = to_torch(a)
    a[0, 0] = 42.0                                   # no copy: the tensor sees the change
    assert t.dtype == torch.float32 and t[0, 0].item() == 42.0
    back = from_torch(t, a)
    assert isinstance(back, np.ndarray) and np.shares_memory(back, a)
    # bf16 travels as uint16 bits both ways
    x = torch.randn(3, 8).to(torch.bfloat16)
    bits = from_torch(x, a, as_bits=True)
    assert bits.dtype == np.uint16
    assert torch.equal(to_torch(bits, payload=True), x)
    assert from_torch(x, a).dtype == np.uint16      # numpy has no bf16: the bits come out
    assert from_torch(None, a) is None
    with pytest.raises(TypeError):
        to_torch([1, 2, 3])


def test_cupy_module_is_not_needed():
    import deepcomm.cupy_ops as ops
    assert ops._namespace(np.zeros(1)) is np


def _worker(rank, world):
    import deepcomm
    from deepcomm import cupy_ops
    from deepcomm.fp8 import per_token_cast_to_fp8
    E, H = 2 * world, 256
    gen = torch.Generator().manual_seed(3 + rank)
    idx = bf.make_topk(gen, 6 + rank, 3, E)
    x = torch.randn(idx.shape[0], H, generator=gen).to(torch.bfloat16)
    w = torch.rand(idx.shape, generator=gen)
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=H)

    got = cupy_ops.dispatch(buf, x.view(torch.uint16).numpy(), idx.numpy(), w.numpy(), E, expert_alignment=4)
    want = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=4)
    assert isinstance(got[0], np.ndarray) and got[0].dtype == np.uint16
    assert torch.equal(torch.from_numpy(got[0]).view(torch.bfloat16), want[0])
    assert np.array_equal(got[1], want[1].numpy()) and np.array_equal(got[2], want[2].numpy())
    assert got[3] == want[3]

    y = (want[0].float() * 3).to(torch.bfloat16)
    cx, cw = cupy_ops.combine(buf, y.view(torch.uint16).numpy(), got[4], topk_weights=got[2])
    wx, ww = buf.combine(y, want[4], topk_weights=want[2])
    assert torch.equal(torch.from_numpy(cx).view(torch.bfloat16), wx) and np.array_equal(cw, ww.numpy())

    # fp32 payload (reference backend) and an FP8 pair given as (uint8 bits, fp32 scales)
    x32 = torch.randn(idx.shape[0], H, generator=gen)
    got32 = cupy_ops.dispatch(buf, x32.numpy(), idx.numpy(), None, E)
    assert got32[2] is None and np.array_equal(got32[0], buf.dispatch(x32, topk_idx=idx, num_experts=E)[0].numpy())
    vals, scales = per_token_cast_to_fp8(x)
    got8 = cupy_ops.dispatch(buf, (vals.view(torch.uint8).numpy(), scales.numpy()), idx.numpy(), None, E)
    want8 = buf.dispatch((vals, scales), topk_idx=idx, num_experts=E)[0]
    assert got8[0][0].dtype == np.uint8
    assert torch.equal(torch.from_numpy(got8[0][0]), want8[0].view(torch.uint8))
    assert np.array_equal(got8[0][1], want8[1].numpy())
    buf.destroy()
    return True


def test_functional_api_on_numpy_matches_torch():
    assert run_ranks(_worker, 2) == [True, True]
