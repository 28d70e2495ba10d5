"""Where the time of a low-latency dispatch/combine goes: host time per eager call, and device time per kernel
(torch.profiler) for 1 and 128 tokens, both for eager calls (kernel times there include waiting for a peer that
the host launched later) and for CUDA-graph replays (20 calls of one kind per graph: the kernels' own time). A
diagnostic for kernel work, not the benchmark: `python dev/profile_low_latency.py` on 2 GPUs."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the repository, for tests.helpers
from tests.helpers.nccl_run import run_on_gpus  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from profile_intranode import _timed  # noqa: E402

from deepcomm.bench.peers import replay_graph  # noqa: E402

os.environ.setdefault("DEEPCOMM_LL_TRACE", "1")  # per-block timer stamps of the latest call (ll_buffer.py)
E, H, K, M = 256, 7168, 8, 128
TRACE_NAMES = ("entry", "send rows", "send keys", "finished", "weights", "arrived", "recv meta", "end", "counts",
               "ranked")


def trace_table(trace: torch.Tensor, blocks: int) -> str:
    """Microseconds from the first block's entry to each stamp of the latest call: min / median / max over the
    blocks that stamped it (a point a kernel does not pass stays 0 and is left out)."""
    t = trace[:blocks].cpu()
    entry = t[:, 0]
    t0 = int(entry[entry > 0].min())
    rows = []
    for p, name in enumerate(TRACE_NAMES):
        col = t[:, p]
        col = col[col >= t0]
        if col.numel():
            us = (col - t0).double() / 1e3
            rows.append(f"{name:>10}: {us.min():7.2f} {us.median():7.2f} {us.max():7.2f}  ({col.numel()} blocks)")
    return "\n".join(rows)
GRAPH_CALLS = 20


def graph_time_us(replay, iters=20):
    """Median device microseconds of one replay (events), the ranks lined up by a barrier before each."""
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def worker(rank, world):
    import deepcomm
    from torch.profiler import ProfilerActivity, profile
    dev = torch.device("cuda", rank)
    buf = deepcomm.Buffer(max_tokens_per_rank=M, hidden=H, backend="cuda", num_max_low_latency_tokens=M)
    g = torch.Generator(device=dev).manual_seed(rank)
    for T in (1, M):
        idx = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
        w = torch.rand(T, K, device=dev, generator=g)
        x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
        y = torch.randn(E // world, world * M, H, device=dev, generator=g).to(torch.bfloat16)
        _, _, h, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        calls = {
            "dispatch fp8": lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=True),
            "dispatch bf16": lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False),
            "combine": lambda: buf.low_latency_combine(y, idx, w, h),
        }
        host = {k: _timed(fn, 50, wait_for_device=False) for k, fn in calls.items()}
        dist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                for fn in calls.values():
                    fn()
            torch.cuda.synchronize()
        if rank == 0:
            print(f"--- tokens {T}: host us per eager call (launch side, no sync): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in host.items()))
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10))
        for name, fn in calls.items():
            replay = replay_graph(fn, GRAPH_CALLS)
            per_call = graph_time_us(replay) / GRAPH_CALLS
            dist.barrier()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    replay()
                torch.cuda.synchronize()
            ll = buf._backend.ll.buffer
            if ll is not None and ll.trace is not None:
                ll.trace.zero_()
                dist.barrier()
                replay()
                torch.cuda.synchronize()
                table = trace_table(ll.trace, buf._backend.ll.blocks)
            for r in range(world):
                if r == rank:
                    if rank == 0:
                        print(f"--- tokens {T}, {name}, CUDA graph of {GRAPH_CALLS} calls: {per_call:.1f} us per call")
                        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6))
                    if ll is not None and ll.trace is not None:
                        print(f"rank {rank}, last call of the graph, us from the first entry (min / median / max):")
                        print(table, flush=True)
                dist.barrier()
    buf.destroy()


if __name__ == "__main__":
    run_on_gpus(worker, 2)
