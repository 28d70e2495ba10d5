"""Logical byte counts (BENCHMARK.md "Metric").

Logical bytes = rows one rank receives from every rank (itself included) x bytes per row.
A row is H elements (1 byte each for FP8, 2 for BF16) plus, for FP8, one fp32 scale per 128 elements.
Combine counts the same rows as the matching BF16 dispatch. Low-latency mode uses the same count
(each token once per destination rank); its headline number is the time in microseconds.
"""
from __future__ import annotations

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
    """Bytes behind one call of `op`; combine is always counted as BF16 rows."""
    if op == "combine":
        dtype = "bf16"
    return num_recv_rows * row_bytes(hidden, dtype)


def gbps(nbytes: int, time_us: float) -> float:
    """GB/s with GB = 1e9 bytes."""
    return nbytes / (time_us * 1e-6) / 1e9 if time_us > 0 else float("nan")
