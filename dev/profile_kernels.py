"""GPU time of normal-mode calls, kernel by kernel: each call's kernels as the CUDA profiler sees them (µs per
call, median over the calls) and the call's span from its first kernel's start to its last one's end, at each SM
count, and the GPU time of a CUDA graph of worst-case dispatches and
combines replayed back to back (no host gaps). Beside them, the time torch's own copy takes to move the same
bytes on this GPU (all SMs), as a yardstick. A diagnostic, not the benchmark:
`python dev/profile_kernels.py [--tokens 128,4096] [--sms 8,24] [--json PATH]`, world size 1 (one GPU)."""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the repository, for dev.profile_host
from dev.profile_host import setup_calls  # noqa: E402
from tests.helpers.nccl_run import run_on_gpus  # noqa: E402

CALLS = 30


def _kernel_times(fn, calls=CALLS):
    """``({kernel name: median µs per call}, median span)`` of ``fn``'s kernels over ``calls`` calls
    (torch.profiler, CUDA only). The span of a call runs from its first kernel's start to its last kernel's end:
    kernels that overlap (a payload launched behind notify with programmatic dependent launch is resident, and
    timed, while notify runs) count once there, where the per-kernel times add the overlap twice."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_name, ranges = collections.defaultdict(list), collections.defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            per_name[ev.name].append(ev.device_time)
            ranges[ev.name].append((ev.time_range.start, ev.time_range.end))
    out, every_call = {}, []
    for name, times in per_name.items():
        if len(times) >= calls:  # kernels of every call (not one-off set-up work)
            per_call = [sum(times[i::calls]) for i in range(calls)] if len(times) % calls == 0 else times
            out[name[:60]] = round(statistics.median(per_call), 1)
            if len(times) % calls == 0:
                every_call += ranges[name]
    every_call.sort()
    per = len(every_call) // calls  # kernels per call: the calls' kernels in start order, call by call
    spans = [max(e for _, e in every_call[i * per:(i + 1) * per]) - every_call[i * per][0] for i in range(calls)]
    return out, round(statistics.median(spans), 1) if per else 0.0


def _graph_us(fn, reps=10):
    """GPU µs per ``fn`` when ``reps`` of them are captured in one CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return round(statistics.median(times), 1)


def _copy_us(nbytes: int, dev) -> float:
    """torch's device-to-device copy of ``nbytes`` (all SMs or the copy engine, torch decides), µs."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        b.copy_(a)
    times = []
    for _ in range(20):
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return round(statistics.median(times), 1)


def worker(rank, world, tokens_list, sms_list, hidden, json_path):
    dev = torch.device("cuda", rank)
    rows = []
    for tokens in tokens_list:
        for sms in sms_list:
            buf, idx, w, x, fp8, h, y = setup_calls(rank, tokens, hidden, sms)
            worst = tokens  # world size 1: every row stays here
            cases = {
                "fresh dispatch bf16": lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=256),
                "fresh dispatch fp8": lambda: buf.dispatch(fp8, topk_idx=idx, topk_weights=w, num_experts=256),
                "cached dispatch bf16": lambda: buf.dispatch(x, handle=h),
                "cached dispatch fp8": lambda: buf.dispatch(fp8, handle=h),
                "combine": lambda: buf.combine(y, h),
                "get_dispatch_layout": lambda: buf.get_dispatch_layout(idx, 256),
            }
            for name, fn in cases.items():
                kernels, span = _kernel_times(fn)
                rows.append({"call": name, "tokens": tokens, "num_sms": sms, "kernels_us": kernels,
                             "gpu_us": round(sum(kernels.values()), 1), "span_us": span})

            def worst_step():
                rx, _, rw, _, hh = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=256,
                                                num_worst_tokens=worst)
                buf.combine(rx, hh, topk_weights=rw)
            rows.append({"call": "graph: worst-case dispatch + combine bf16", "tokens": tokens, "num_sms": sms,
                         "gpu_us": _graph_us(worst_step)})
            buf.destroy()
        rows.append({"call": "torch copy of x's bytes (yardstick)", "tokens": tokens, "num_sms": 0,
                     "gpu_us": _copy_us(tokens * hidden * 2, dev)})
    for r in rows:
        span = f"span {r['span_us']:6.1f}" if "span_us" in r else " " * 11
        print(f"{r['call']:44s} {r['tokens']:6d} {r['num_sms']:3d} {r['gpu_us']:8.1f} {span}  {r.get('kernels_us', '')}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"world_size": world, "hidden": hidden, "rows": rows, "device": torch.cuda.get_device_name(dev),
                       "commit": os.environ.get("DEEPCOMM_COMMIT", "")}, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="128,4096")
    p.add_argument("--sms", default="8,24")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--json", default="")
    a = p.parse_args()
    run_on_gpus(worker, 1, [int(t) for t in a.tokens.split(",")], [int(s) for s in a.sms.split(",")], a.hidden,
                a.json, timeout_s=400)
