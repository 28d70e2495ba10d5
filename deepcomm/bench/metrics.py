"""Logical byte counts (docs/benchmarks/README.md, "Metric").

Logical bytes = rows one rank receives from every rank (itself included) x bytes per row.
A row is H elements (1 byte each for FP8, 2 for BF16) plus, for FP8, one fp32 scale per 128 elements.
Combine counts the same rows as the dispatch of its dtype (the FP8 combine sends FP8 rows). Low-latency mode
uses the same count (each token once per destination rank); its headline number is the time in microseconds.

The FP8 combine's accuracy is reported against the BF16 combine of the same inputs (``combine_errors``).
"""
from __future__ import annotations

import torch

ELEM_BYTES = {"fp8": 1, "bf16": 2}


def row_bytes(hidden: int, dtype: str) -> int:
    if dtype not in ELEM_BYTES:
        raise ValueError(f"dtype: expected one of {sorted(ELEM_BYTES)}, got {dtype!r}")
    n = hidden * ELEM_BYTES[dtype]
    if dtype == "fp8":
        if hidden % 128:
            raise ValueError(f"hidden: FP8 needs a multiple of 128, got {hidden}")
        n += hidden // 128 * 4
    return n


def logical_bytes(num_recv_rows: int, hidden: int, op: str, dtype: str) -> int:
    """Bytes behind one call of `op` (dispatch or combine) with rows of `dtype`."""
    if op not in ("dispatch", "combine"):
        raise ValueError(f"op: expected dispatch or combine, got {op!r}")
    return num_recv_rows * row_bytes(hidden, dtype)


def combine_errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, float]:
    """Error of one rank's combined rows ``got`` against ``want`` (both ``[T, H]``), as partial sums that add
    up over ranks: ``(max_rel, sum_abs_err, sum_abs_want)``.

    - ``max_rel``: the largest per-token ratio ``max_i |got - want| / max_i |want|`` (error relative to the token's
      largest element; a token that is all zeros in ``want`` counts its absolute error);
    - mean relative error over all ranks = ``sum(sum_abs_err) / sum(sum_abs_want)``.
    """
    if got.shape != want.shape:
        raise ValueError(f"got: shape {tuple(got.shape)} differs from want {tuple(want.shape)}")
    g, w = got.double(), want.double()
    diff = (g - w).abs()
    if diff.numel() == 0:
        return 0.0, 0.0, 0.0
    peak = w.abs().amax(dim=1)
    per_token = diff.amax(dim=1) / torch.where(peak > 0, peak, torch.ones_like(peak))
    return float(per_token.max()), float(diff.sum()), float(w.abs().sum())


def gbps(nbytes: int, time_us: float) -> float:
    """GB/s with GB = 1e9 bytes."""
    return nbytes / (time_us * 1e-6) / 1e9 if time_us > 0 else float("nan")
