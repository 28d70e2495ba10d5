"""One normal-mode dispatch as the CUDA backend moves it (deepcomm/nvlink/backend.py): what it sends
(``DispatchCall``), what it returns (``Received``), and its outputs made as views of an arena block (``carve``)."""
from __future__ import annotations

from typing import Optional

import torch

from ..cuda.arena import Arena


class DispatchCall:
    """What one dispatch moves: its sizes, the payload's addresses and row sizes, its outputs' DLPack types
    (Arena.dlpack_type), its fingerprint's words and its stream order (from CudaBackend._order). Made from the tensors
    (``of_tensors``) or from what the C++ argument reader read of them (``of_read``)."""
    __slots__ = ("T", "H", "K", "fresh", "x_ptr", "scales_ptr", "weights_ptr", "idx_ptr", "with_weights",
                 "x_row_bytes", "scale_row_bytes", "x_type", "x_view", "scale_type", "order", "words")

    @classmethod
    def of_tensors(cls, values: torch.Tensor, scales: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                   topk_idx: Optional[torch.Tensor], K: int, fresh: bool, words: tuple, types: dict) -> "DispatchCall":
        # fresh: a dispatch without a handle, whose outputs include the received topk_idx
        c = cls.__new__(cls)
        c.T, c.H = values.shape
        c.K, c.fresh, c.words = K, fresh, words
        c.x_ptr = values.data_ptr()
        c.idx_ptr = topk_idx.data_ptr() if topk_idx is not None else 0
        c.with_weights = weights is not None
        c.weights_ptr = weights.data_ptr() if weights is not None else 0
        c.x_row_bytes = c.H * values.element_size()
        c.x_type, c.x_view = types[values.dtype]
        if scales is not None:
            c.scales_ptr = scales.data_ptr()
            c.scale_row_bytes = scales.shape[1] * scales.element_size()
            c.scale_type = types[scales.dtype][0]
        else:
            c.scales_ptr = c.scale_row_bytes = c.scale_type = 0
        return c

    @classmethod
    def of_read(cls, read: tuple, types: dict, fresh: bool) -> "DispatchCall":
        """A dispatch from the tuple of DispatchArgReader.fresh or .cached (deepcomm/cuda/arg_reader.py)."""
        c = cls.__new__(cls)
        (c.T, c.H, c.K, _, x_dtype, scales_dtype, c.x_row_bytes, c.scale_row_bytes, c.x_ptr, c.scales_ptr, c.idx_ptr,
         c.weights_ptr, c.with_weights, c.words) = read
        c.fresh = fresh
        c.x_type, c.x_view = types[x_dtype]
        c.scale_type = types[scales_dtype][0] if scales_dtype is not None else 0
        return c

    def typed(self, views: tuple) -> tuple:
        """The outputs a crossing made, with x viewed as its dtype where the arena made it as bytes."""
        if self.x_view is not None:
            return (views[0].view(self.x_view),) + tuple(views[1:])
        return views


class Received:
    """A dispatch's outputs ``(x, scales, topk_idx, topk_weights)`` (None where absent), its rows per local expert,
    and the tensors its kernels use (kept alive when async)."""
    __slots__ = ("out", "per_expert", "keep")

    def __init__(self, out: tuple, per_expert, keep: tuple):
        self.out, self.per_expert, self.keep = out, per_expert, keep


def carve(arena: Arena, reserved, n: int, call: DispatchCall, bounce: bool = False) -> tuple:
    """The dispatch outputs ``(x, scales, topk_idx, topk_weights)`` (None where absent) over one output block
    (``reserved``: its offset and size in the arena) carved for ``n`` rows (csrc/runtime/dispatch_views.hpp), made
    in one crossing. Each holds the block, which returns to the arena when the last of them dies (the bounce area
    is not the arena's: nothing returns)."""
    return call.typed(arena.core.dispatch_views(reserved[0], reserved[1], not bounce, n, call.x_type, call.x_row_bytes,
                                                call.scale_type, call.scale_row_bytes, call.K, call.fresh,
                                                call.with_weights))


class OutputTypes(dict):
    """dtype -> Arena.dlpack_type(dtype), asked of the arena once per dtype."""

    def __init__(self, arena: Arena):
        super().__init__()
        self._arena = arena

    def __missing__(self, dtype):
        self[dtype] = got = self._arena.dlpack_type(dtype)
        return got
