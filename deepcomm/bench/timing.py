"""One timer for every system: warm-up, back-to-back calls, mean and median, slowest rank (docs/benchmarks).

GPU: CUDA events around each call after warm-up, with the L2 cache flushed (a 256 MB write) right before
the timed loop. CPU: time.perf_counter around each call, every call started together after a barrier.
Host time: time.perf_counter from a call's entry to its return (on GPU, the CPU side of the same timed calls:
what the caller's thread spends, a fresh dispatch's wait for its counts included).
The reported numbers are those of the slowest rank (all_reduce MAX).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

L2_FLUSH_BYTES = 256 << 20
_flush_buf: torch.Tensor | None = None


@dataclass
class Timing:
    mean_us: float
    median_us: float
    host_us: float = 0.0  # median host time per call


def flush_l2(device: torch.device) -> None:
    global _flush_buf
    if _flush_buf is None or _flush_buf.device != device:
        _flush_buf = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device=device)
    _flush_buf.fill_(1)


def _time_cuda(fn: Callable[[], object], iters: int, device: torch.device, group) -> tuple[list[float], list[float]]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    host = [0.0] * iters
    flush_l2(device)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    clock = time.perf_counter
    for i in range(iters):
        starts[i].record()
        t0 = clock()
        fn()
        host[i] = (clock() - t0) * 1e6
        ends[i].record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)], host


def _time_cpu(fn: Callable[[], object], iters: int, group) -> list[float]:
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return times


def slowest_rank(values: list[float], device: torch.device, group=None) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def bench(fn: Callable[[], object], warmup: int, iters: int, device: torch.device, group=None) -> Timing:
    """Time `fn` on every rank; returns the slowest rank's mean and median in microseconds."""
    if iters < 1:
        raise ValueError(f"iters: must be >= 1, got {iters}")
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        times, host = _time_cuda(fn, iters, device, group)
    else:
        times = host = _time_cpu(fn, iters, group)
    mean, median, host_median = slowest_rank([statistics.fmean(times), statistics.median(times),
                                              statistics.median(host)], device, group)
    return Timing(mean_us=mean, median_us=median, host_us=host_median)
