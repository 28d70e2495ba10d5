"""The FP8 ``(values, scales)`` pairs DeepEP's normal-mode dispatch takes, brought to the form deepcomm takes.

DeepEP copies a token's scales as an opaque row of ``S`` words with any strides: column-major scales (its own
tests pass ``scales.T.contiguous().T``), one scale per token (``[T, 1]``), or one per 128 columns. deepcomm carries
one word per 128 columns (fp32 ``[T, H/128]``) or per 512 (UE8M0-packed int32 ``[T, H/512]``), contiguous. A row of
``S`` words where ``S`` divides that count is widened by repeating each word (every word then covers
``(H/128)/S`` blocks, which is what it meant), and the received rows are narrowed back to DeepEP's ``S`` columns.
"""
from __future__ import annotations

from typing import Callable, Tuple

import torch

BLOCK = 128


def _fail(name: str, message: str):
    raise ValueError(f"{name}: {message}")


def _identity(recv):
    return recv


def adapt(x) -> Tuple[object, Callable]:
    """``(x for deepcomm, recv_x -> recv_x for the DeepEP caller)``; a bf16 tensor passes as is."""
    if not isinstance(x, tuple):
        return x, _identity
    if len(x) != 2:
        _fail("x", f"an FP8 input is a (values, scales) pair, got {len(x)} items")
    values, scales = x
    if not isinstance(values, torch.Tensor) or not isinstance(scales, torch.Tensor):
        _fail("x", "an FP8 input is a pair of tensors")
    if scales.dim() != 2:
        _fail("x[1]", f"expected 2 dimensions [num_tokens, num_scales] (as DeepEP), got shape {tuple(scales.shape)}")
    if values.dim() != 2 or scales.shape[0] != values.shape[0]:
        return x, _identity   # deepcomm names what is wrong
    hidden = values.shape[1]
    per_word = BLOCK * (4 if scales.dtype == torch.int32 else 1)
    want = hidden // per_word if hidden % per_word == 0 else 0
    have = scales.shape[1]
    if have == want or want == 0:
        return (values, scales.contiguous()), _identity
    if have == 0 or want % have:
        _fail("x[1]", f"{have} scales per token: deepcomm carries {want} per token ({per_word} columns each) and "
                      f"can widen a count that divides it, not {have}")
    repeat = want // have
    wide = scales.repeat_interleave(repeat, dim=1)

    def narrow(recv):
        recv_values, recv_scales = recv
        return recv_values, recv_scales[:, ::repeat].contiguous()
    return (values, wide), narrow
