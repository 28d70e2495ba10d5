"""FP8 (e4m3) per-token, per-128-block quantization helpers.

These functions are the specification the CUDA kernels are checked against bit for bit, so every step is
plain fp32 arithmetic with one rounding each:

    amax  = max(max_i |x_i|, 1e-4)                      (fp32, over a block of 128)
    scale = amax / 448                                  (IEEE fp32 division, round to nearest even)
    UE8M0 (optional): scale = 2^(e+1) if scale has any mantissa bit set, where e is its biased exponent
    value = e4m3(clamp(x_fp32 / scale, -448, 448))      (IEEE fp32 division, then round to nearest even)
"""
from __future__ import annotations

from typing import Tuple

import torch

BLOCK = 128          # hidden elements per scale
FP8_MAX = 448.0      # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-4    # keeps all-zero blocks from producing a zero scale
_PACK = 4            # UE8M0 exponents per int32


def _check_hidden(name: str, t: torch.Tensor, multiple: int) -> int:
    if t.dim() < 1 or t.shape[-1] % multiple != 0:
        raise ValueError(f"{name}: last dimension must be a multiple of {multiple}, got shape {tuple(t.shape)}")
    return t.shape[-1]


def ue8m0_round_up(scales: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 scales up to a power of two on the bit pattern: exponent + 1 when any mantissa
    bit is set. Non-finite values (exponent 255) are left unchanged."""
    bits = scales.contiguous().float().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    has_mantissa = (bits & 0x7FFFFF) != 0
    exponent = exponent + (has_mantissa & (exponent != 0xFF)).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def per_token_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``[..., H]`` (``H % 128 == 0``) to ``(values e4m3 [..., H], scales fp32 [..., H/128])``."""
    if not x.is_floating_point():
        raise ValueError(f"x: expected a floating-point tensor, got {x.dtype}")
    hidden = _check_hidden("x", x, BLOCK)
    lead = x.shape[:-1]
    blocks = x.reshape(-1, hidden // BLOCK, BLOCK).float()
    amax = blocks.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    # A tensor divisor on purpose: CUDA torch turns division by a Python scalar into a multiply by its
    # reciprocal, which is not the IEEE quotient the kernels (and the CPU) compute.
    scales = amax / torch.full_like(amax, FP8_MAX)
    if use_ue8m0:
        scales = ue8m0_round_up(scales)
    # clamp first: torch's fp32 -> e4m3fn conversion does not saturate, and x/scale can exceed 448 by an ulp.
    values = (blocks / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.reshape(*lead, hidden), scales.reshape(*lead, hidden // BLOCK)


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Pack fp32 power-of-two scales ``[..., G]`` (``G % 4 == 0``) into int32 ``[..., G/4]``.

    Each int32 holds the biased exponent bytes of 4 consecutive blocks, little-endian (block 0 in the lowest
    byte). Sign and mantissa bits are dropped: pass UE8M0 scales (``per_token_cast_to_fp8(..., use_ue8m0=True)``).
    """
    if scales.dtype != torch.float32:
        raise ValueError(f"scales: expected float32, got {scales.dtype}")
    _check_hidden("scales", scales, _PACK)
    exponent = ((scales.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.int64)
    e = exponent.unflatten(-1, (-1, _PACK))
    word = e[..., 0] | (e[..., 1] << 8) | (e[..., 2] << 16) | (e[..., 3] << 24)
    # reinterpret the unsigned 32-bit word as int32 (two's complement)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_ue8m0``: int32 ``[..., G/4]`` -> fp32 powers of two ``[..., G]``."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed: expected int32, got {packed.dtype}")
    if packed.dim() < 1:
        raise ValueError(f"packed: expected at least 1 dimension, got shape {tuple(packed.shape)}")
    exponent = torch.stack([(packed >> (8 * i)) & 0xFF for i in range(_PACK)], dim=-1).flatten(-2)
    return (exponent << 23).view(torch.float32)


def per_token_cast_back(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantize: ``values * scale`` in fp32. ``scales`` is fp32 ``[..., H/128]`` or packed int32 ``[..., H/512]``."""
    if values.dtype != torch.float8_e4m3fn:
        raise ValueError(f"values: expected float8_e4m3fn, got {values.dtype}")
    hidden = _check_hidden("values", values, BLOCK)
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales)
    elif scales.dtype != torch.float32:
        raise ValueError(f"scales: expected float32 or packed int32, got {scales.dtype}")
    if tuple(scales.shape) != (*values.shape[:-1], hidden // BLOCK):
        raise ValueError(f"scales: shape {tuple(scales.shape)} does not match values {tuple(values.shape)}")
    blocks = values.float().reshape(*values.shape[:-1], hidden // BLOCK, BLOCK)
    return (blocks * scales.unsqueeze(-1)).reshape(values.shape)
