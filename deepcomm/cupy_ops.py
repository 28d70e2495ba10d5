"""Functional dispatch / combine on CuPy arrays (or any DLPack array: NumPy on the CPU reference backend).

Arrays cross into torch without a copy (``torch.from_dlpack``; ``__cuda_array_interface__`` as a fallback) and
the outputs go back without a copy (the array library's ``from_dlpack``), so ``recv_x`` of the CUDA backend is
still the buffer peers wrote into. Stream order: DLPack's exchange makes each side wait for the other's current
stream, so CuPy work queued before a call is seen by it, and CuPy work after it sees its results.

bf16 and FP8: CuPy has no bfloat16 or float8 dtypes. Pass such payloads as their bits -- ``uint16`` arrays for bf16,
``uint8`` arrays for e4m3 FP8 values -- and the outputs come back the same way. (An array library that has a native
``bfloat16`` dtype and DLPack support for it works as is.) Scales, weights and indices use ordinary dtypes.

    recv_x, recv_topk_idx, recv_topk_weights, counts, handle = deepcomm.cupy_ops.dispatch(
        buf, x_bits_u16, topk_idx_i64, topk_weights_f32, num_experts)
    combined_x, combined_w = deepcomm.cupy_ops.combine(buf, y_bits_u16, handle)

``cupy`` is imported only when a CuPy array is handed back (this module itself needs only torch).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Optional, Tuple

import torch

if TYPE_CHECKING:  # annotations only
    from .buffer import Buffer
    from .handle import Handle

# integer dtypes that carry the bits of a torch dtype the array library may lack
_BITS_OF = {torch.uint16: torch.bfloat16, torch.uint8: torch.float8_e4m3fn}
_AS_BITS = {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8}


def _namespace(arr):
    """The array's library (``cupy``, ``numpy``, ...), imported lazily from the array's type."""
    root = type(arr).__module__.split(".")[0]
    return importlib.import_module(root)


def to_torch(arr, payload: bool = False) -> torch.Tensor:
    """A torch tensor sharing ``arr``'s memory. ``payload=True``: an integer bits array (``uint16`` / ``uint8``) is
    reinterpreted as bf16 / e4m3 (the payload dtypes CuPy lacks)."""
    if isinstance(arr, torch.Tensor):
        t = arr
    elif hasattr(arr, "__dlpack__"):
        t = torch.from_dlpack(arr)
    elif hasattr(arr, "__cuda_array_interface__"):
        t = torch.as_tensor(arr, device="cuda")
    else:
        raise TypeError(f"expected a DLPack / __cuda_array_interface__ array, got {type(arr).__name__}")
    if payload and t.dtype in _BITS_OF:
        t = t.view(_BITS_OF[t.dtype])
    return t


def from_torch(t: Optional[torch.Tensor], like, as_bits: bool = False):
    """``t`` as an array of ``like``'s library, sharing memory (``None`` stays ``None``). ``as_bits``: bf16 / e4m3
    tensors go out as their ``uint16`` / ``uint8`` bits."""
    if t is None:
        return None
    if as_bits and t.dtype in _AS_BITS:
        t = t.view(_AS_BITS[t.dtype])
    if isinstance(like, torch.Tensor):
        return t
    xp = _namespace(like)
    try:
        return xp.from_dlpack(t)
    except (TypeError, RuntimeError, BufferError):
        if t.dtype in _AS_BITS:   # the library lacks the dtype: hand out the bits
            return xp.from_dlpack(t.view(_AS_BITS[t.dtype]))
        raise


def _is_bits(arr) -> bool:
    dtype = getattr(arr, "dtype", None)
    return str(dtype) in ("uint16", "uint8")


def _payload_in(x):
    """``(torch payload, as_bits)`` for an array or an FP8 ``(values, scales)`` pair."""
    if isinstance(x, (tuple, list)):
        return (to_torch(x[0], payload=True), to_torch(x[1])), _is_bits(x[0])
    return to_torch(x, payload=True), _is_bits(x)


def _payload_out(t, like, as_bits: bool):
    if isinstance(t, (tuple, list)):
        return from_torch(t[0], like[0], as_bits), from_torch(t[1], like[1])
    return from_torch(t, like, as_bits)


def dispatch(buffer: "Buffer", x, topk_idx, topk_weights=None, num_experts: Optional[int] = None, expert_alignment: int = 1,
             handle=None):
    """``buffer.dispatch`` on arrays; returns ``(recv_x, recv_topk_idx, recv_topk_weights,
    num_recv_tokens_per_expert, handle)`` with arrays of ``x``'s library (the list and the ``deepcomm.Handle`` as is).
    ``x``: ``[T, H]`` (bf16 bits as ``uint16``, or fp16/fp32/fp64 on the reference backend) or an FP8 pair
    ``(e4m3 bits uint8 [T, H], fp32 scales [T, H/128])``; ``topk_idx`` int64 ``[T, K]``; ``topk_weights`` fp32."""
    payload, as_bits = _payload_in(x)
    idx = None if topk_idx is None else to_torch(topk_idx)
    weights = None if topk_weights is None else to_torch(topk_weights)
    recv_x, recv_idx, recv_w, counts, out_handle = buffer.dispatch(
        payload, topk_idx=idx, topk_weights=weights, num_experts=num_experts, handle=handle,
        expert_alignment=expert_alignment)
    like = x
    ref = x[0] if isinstance(x, (tuple, list)) else x
    return (_payload_out(recv_x, like, as_bits), from_torch(recv_idx, ref), from_torch(recv_w, ref), counts,
            out_handle)


def combine(buffer: "Buffer", x, handle: "Handle", topk_weights=None) -> Tuple[object, object]:
    """``buffer.combine`` on arrays; returns ``(combined_x, combined_topk_weights)`` in ``x``'s library
    (bf16 as ``uint16`` bits when ``x`` came as bits)."""
    payload, as_bits = _payload_in(x)
    weights = None if topk_weights is None else to_torch(topk_weights)
    combined_x, combined_w = buffer.combine(payload, handle, topk_weights=weights)
    return from_torch(combined_x, x, as_bits), from_torch(combined_w, x)


__all__ = ["combine", "dispatch", "from_torch", "to_torch"]
