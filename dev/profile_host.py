"""Host cost of normal-mode calls: for each call, the loop's wall time per call (GPU included: back-to-back
throughput), the host time from entry to return (median), a fresh dispatch's wait for its counts, and the GPU
time (CUDA events); then the host cost of the torch primitives a call is built from. A diagnostic for the host
path, not the benchmark: `python dev/profile_host.py [--world N] [--tokens 128,4096] [--json PATH]`.
One rank per GPU (speed figures mean nothing on a shared GPU)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the repository, for tests.helpers
from tests.helpers.nccl_run import run_on_gpus  # noqa: E402

ITERS = 200


def _host_times(fn, backend=None, iters=ITERS):
    """(loop wall us per call incl. GPU, median host us per call, median wait us, median GPU us)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    host, waits = [], []
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    clock = time.perf_counter
    t_loop = clock()
    for i in range(iters):
        starts[i].record()
        t0 = clock()
        fn()
        host.append((clock() - t0) * 1e6)
        ends[i].record()
        if backend is not None:
            waits.append(getattr(backend, "last_wait_us", 0.0))
    torch.cuda.synchronize()
    wall = (clock() - t_loop) / iters * 1e6
    gpu = statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
    return {"wall_us": round(wall, 1), "host_us": round(statistics.median(host), 1),
            "wait_us": round(statistics.median(waits), 1) if waits else 0.0, "gpu_us": round(gpu, 1)}


def _no_grad(fn, *args):
    with torch.no_grad():
        return fn(*args)


def _primitives(dev):
    """Host microseconds of the torch operations a call is made of (median of 2000)."""
    from deepcomm.cuda.arena import as_device_bytes
    base = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    ev = torch.cuda.Event()
    ops = {
        "torch.empty cuda": lambda: torch.empty(4096, 8, dtype=torch.int32, device=dev),
        "slice+view+view": lambda: base[256:256 + 4096].view(torch.int32).view(128, 8),
        "as_tensor (CAI)": lambda: as_device_bytes(base.data_ptr(), 4096, dev),
        "current_stream": lambda: torch.cuda.current_stream(dev),
        "event.record": lambda: ev.record(),
        "data_ptr": lambda: base.data_ptr(),
    }
    out = {}
    for name, fn in ops.items():
        times = []
        for _ in range(2000):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        out[name] = round(statistics.median(times), 2)
    return out


def setup_calls(rank, tokens, hidden, num_sms):
    """A CUDA Buffer and the DeepSeek-V3-shaped inputs of one rank (top-8 of 256 experts), with one fresh dispatch
    made: ``(buf, idx, w, x, fp8, handle, y)``, y being expert outputs for that dispatch's rows."""
    import deepcomm
    from deepcomm.fp8 import per_token_cast_to_fp8
    dev = torch.device("cuda", rank)
    buf = deepcomm.Buffer(max_tokens_per_rank=tokens, hidden=hidden, backend="cuda", num_sms=num_sms)
    g = torch.Generator(device=dev).manual_seed(rank)
    idx = torch.rand(tokens, 256, device=dev, generator=g).topk(8, dim=1).indices
    w = torch.rand(tokens, 8, device=dev, generator=g)
    x = torch.randn(tokens, hidden, device=dev, generator=g).to(torch.bfloat16)
    fp8 = per_token_cast_to_fp8(x)
    recv, _, _, _, h = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=256)
    return buf, idx, w, x, fp8, h, torch.randn_like(recv)


def _cprofile(cases, path, tokens, iters=500):
    """Each call ``iters`` times under cProfile: the functions with the most own time, into ``path``."""
    import cProfile
    import io
    import pstats
    with open(path, "a") as f:
        for name, (fn, _) in cases.items():
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(iters):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(28)
            f.write(f"==== {name}, {tokens} tokens, {iters} calls ====\n{text.getvalue()}\n")


class _Recorder:
    """Stands in for the NvlContext of a backend: records the crossings' results (``real`` set) or replays them
    without crossing (``real`` None), so that a call's Python part can be timed alone."""

    def __init__(self, real):
        self.real, self.results = real, {}

    def dispatch_call(self, flags, *args):
        if self.real is not None:
            self.results[flags] = self.real.dispatch_call(flags, *args)
        return self.results[flags]

    def dispatch_into(self, arena, arena_at, reserve_rows, x_type, scale_type, with_idx, with_weights, flags, *args):
        # replayed, the outputs are the recorded call's views (their making counts as crossing)
        if self.real is not None:
            self.results["into", flags] = self.real.dispatch_into(arena, arena_at, reserve_rows, x_type, scale_type,
                                                                  with_idx, with_weights, flags, *args)
        return self.results["into", flags]

    def combine_call(self, *args):
        if self.real is not None:
            self.real.combine_call(*args)

    def dispatch_layout(self, *args):
        if self.real is not None:
            self.real.dispatch_layout(*args)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _breakdown(be, cases):
    """Host microseconds of each call (a) as a whole, (b) without the crossing into C++ (the Python part, torch
    tensor creation included), (c) the difference (the crossing: argument conversion, stream order, launches).
    Only on the ranks' first Buffer, world size 1."""
    real = be.nvl.ctx
    rec = _Recorder(real)
    out = {}
    try:
        for name, (fn, _) in cases.items():
            if name.startswith(("ops.", "operator")):
                continue
            be.nvl.ctx = rec
            rec.real = real
            fn()
            torch.cuda.synchronize()
            rec.real = None  # replay: nothing launched
            py = _host_times(fn, iters=ITERS)["host_us"]
            be.nvl.ctx = real
            whole = _host_times(fn, iters=ITERS)["host_us"]
            out[name] = {"host_us": whole, "python_us": py, "crossing_us": round(whole - py, 1)}
    finally:
        be.nvl.ctx = real
    small = torch.zeros(1, device=be.device)
    out["one torch kernel launch (small.add_)"] = {"host_us": _host_times(lambda: small.add_(1))["host_us"]}
    return out


def worker(rank, world, tokens_list, hidden, num_sms, json_path, cprofile_path=""):
    dev = torch.device("cuda", rank)
    rows = []
    split = {}
    for tokens in tokens_list:
        buf, idx, w, x, fp8, h, y = setup_calls(rank, tokens, hidden, num_sms)
        be = buf._backend
        from deepcomm import ops
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        cases = {
            "fresh dispatch bf16": (lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=256), be),
            "fresh dispatch fp8": (lambda: buf.dispatch(fp8, topk_idx=idx, topk_weights=w, num_experts=256), be),
            "cached dispatch bf16": (lambda: buf.dispatch(x, handle=h), None),
            "cached dispatch fp8": (lambda: buf.dispatch(fp8, handle=h), None),
            "combine": (lambda: buf.combine(y, h), None),
            "get_dispatch_layout": (lambda: buf.get_dispatch_layout(idx, 256), None),
            # the differentiable calls (torch custom operators and autograd), what an MoE layer calls
            "ops.dispatch (autograd)": (lambda: ops.dispatch(buf, xg, idx, wg, 256), be),
            "ops.combine (autograd)": (lambda: ops.combine(buf, y, h), None),
            # the same under torch.no_grad (inference, prefill): the Buffer's calls without autograd
            "ops.dispatch (no grad)": (lambda: _no_grad(ops.dispatch, buf, xg, idx, wg, 256), be),
            "ops.combine (no grad)": (lambda: _no_grad(ops.combine, buf, y, h), None),
            # the same calls through their torch operators, as traced code runs them (eager ops skip them)
            "operator dispatch (autograd)": (lambda: torch.ops.deepcomm.dispatch(buf.buffer_id, xg, None, idx, wg, 256,
                                                                                1, 0), be),
            "operator combine (autograd)": (lambda: torch.ops.deepcomm.combine(buf.buffer_id, y, None,
                                                                               *ops.handle_args(h), False), None),
        }
        if cprofile_path and rank == 0 and tokens == min(tokens_list):
            _cprofile(cases, cprofile_path, tokens)
        if world == 1:
            split[tokens] = _breakdown(be, cases)
        for name, (fn, backend) in cases.items():
            r = _host_times(fn, backend)
            r.update(call=name, tokens=tokens, world_size=world, num_sms=num_sms)
            rows.append(r)
        dist.barrier()
        buf.destroy()
    prims = _primitives(dev)
    if rank == 0:
        print(f"{'call':24s} {'tokens':>6s} {'wall':>8s} {'host':>8s} {'wait':>8s} {'gpu':>8s}   (us per call)")
        for r in rows:
            print(f"{r['call']:24s} {r['tokens']:6d} {r['wall_us']:8.1f} {r['host_us']:8.1f} {r['wait_us']:8.1f} "
                  f"{r['gpu_us']:8.1f}")
        print("torch primitives (host us):", json.dumps(prims))
        for tokens, parts in split.items():
            print(f"host split at {tokens} tokens (whole / Python part / crossing, us):")
            for name, r in parts.items():
                print(f"  {name:36s} {r['host_us']:7.1f} {r.get('python_us', float('nan')):7.1f} "
                      f"{r.get('crossing_us', float('nan')):7.1f}")
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"world_size": world, "hidden": hidden, "num_sms": num_sms, "rows": rows,
                           "primitives": prims, "host_split": split, "device": torch.cuda.get_device_name(dev),
                           "commit": os.environ.get("DEEPCOMM_COMMIT", "")}, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--tokens", default="128,4096")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--num-sms", type=int, default=24)
    p.add_argument("--json", default="")
    p.add_argument("--cprofile", default="", help="also write each call's cProfile (smallest token count) here")
    a = p.parse_args()
    run_on_gpus(worker, a.world, [int(t) for t in a.tokens.split(",")], a.hidden, a.num_sms, a.json, a.cprofile,
                timeout_s=600)
