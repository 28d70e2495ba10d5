"""Every compiled tuning variant of the normal-mode kernels in one run, world size 1 (one GPU), 4096 tokens, at 8
and 24 SMs: the dispatch kernel's GPU time for each DEEPCOMM_DISPATCH_UNROLL x DEEPCOMM_DISPATCH_PREFETCH variant,
fused with notify into one launch or not (DEEPCOMM_DISPATCH_FUSED)
(BF16 and FP8, fresh and cached), the combine kernel's for each DEEPCOMM_COMBINE_CONFIG, each variant's outputs
checked equal to the default variant's (which the tests prove bit-exact against the reference) on plain and ugly
routing; then the notify kernel's phase stamps at 128 and 4096 tokens. The variants are switched in-process with
deepcomm._C.set_tuning. A diagnostic, not the benchmark:
`python dev/profile_sweep.py [--json PATH] [--trace-only]`; fails (non-zero exit) when a variant's outputs differ.
``--trace-only``: the notify trace alone (24 SMs), in both launch modes."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the repository, for dev.* and tests.helpers
from dev.profile_host import setup_calls  # noqa: E402
from dev.profile_kernels import _kernel_times  # noqa: E402
from tests.helpers.nccl_run import run_on_gpus  # noqa: E402

TOKENS, TRACE_TOKENS, SMS, E = 4096, (128, 4096), (8, 24), 256
# (unroll, prefetch, fused: notify and payload in one launch); the first is the default
DISPATCH_VARIANTS = ((16, 1, 0), (16, 1, 1), (8, 0, 0), (16, 0, 0), (8, 1, 0))
COMBINE_CONFIGS = (0, 1, 2, 3, 4, 5, 6)  # 0 is the default; 6 the bulk reducers
CALLS, TRACE_CALLS = 20, 30


def _kernel_us(kernels: dict, part: str) -> float:
    """GPU µs per call of the kernels whose name holds ``part`` (0 when none ran)."""
    return round(sum(us for name, us in kernels.items() if part in name), 1)


def _snapshot(out):
    """The tensors of a call's result, cloned (dispatch outputs live in the buffer and a later call reuses it),
    in order; a handle contributes its routing tensors."""
    flat = []

    def walk(o):
        if isinstance(o, torch.Tensor):
            flat.append(o.clone())
        elif isinstance(o, (tuple, list)):
            for item in o:
                walk(item)
        elif o is None or isinstance(o, (int, float)):
            flat.append(o)
        elif hasattr(o, "send_pos"):  # a Handle
            flat.append(o.num_recv)
            for name in ("count_matrix", "send_pos", "recv_src_idx", "is_token_in_rank"):
                flat.append(getattr(o, name).clone())
        else:
            flat.append(type(o).__name__)
    walk(out)
    return flat


def _same(a, b) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                    and x.dtype == y.dtype and torch.equal(x.view(torch.uint8) if x.dtype.itemsize == 1 else x,
                                                           y.view(torch.uint8) if y.dtype.itemsize == 1 else y)):
                return False
        elif x != y:
            return False
    return True


def _ugly_ids(idx: torch.Tensor) -> torch.Tensor:
    """``idx`` with unused slots (-1) and tokens routed nowhere, so that the skip paths run."""
    ugly = idx.clone()
    ugly[::7, :3] = -1
    ugly[::13] = -1
    return ugly


def _received_rows(buf, out):
    """A worst-case-size dispatch's outputs with recv_x cut to the received rows: the kernels leave the padding
    rows of recv_x unwritten (docs/api.md), so only the other outputs are defined there."""
    handle = out[4]
    n = int(handle.count_matrix[:, buf.rank].sum())
    return (out[0][:n], *out[1:])


def _dispatch_checks(buf, x, fp8, idx, w, tokens):
    """name -> (call, result snapshot): the dispatches every variant's outputs are compared on."""
    ugly = _ugly_ids(idx)
    _, _, _, _, h_plain = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    return {
        "fresh bf16": lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E),
        "fresh fp8": lambda: buf.dispatch(fp8, topk_idx=idx, topk_weights=w, num_experts=E),
        "fresh bf16 ugly ids": lambda: buf.dispatch(x, topk_idx=ugly, topk_weights=w, num_experts=E),
        "fresh fp8 ugly ids": lambda: buf.dispatch(fp8, topk_idx=ugly, topk_weights=w, num_experts=E),
        "fresh bf16 worst-case rows": lambda: _received_rows(buf, buf.dispatch(
            x, topk_idx=ugly, topk_weights=w, num_experts=E, num_worst_tokens=tokens)),
        "cached fp8": lambda: buf.dispatch(fp8, handle=h_plain),
    }


def _combine_checks(buf, x, idx, w, hidden):
    """name -> call: the combines every config's outputs are compared on (plain and ugly routing, with weights)."""
    g = torch.Generator(device=x.device).manual_seed(7)
    calls = {}
    for name, ids in (("plain", idx), ("ugly ids", _ugly_ids(idx))):
        recv, _, rw, _, h = buf.dispatch(x, topk_idx=ids, topk_weights=w, num_experts=E)
        y = torch.randn(recv.shape[0], hidden, device=x.device, generator=g).to(torch.bfloat16)
        rw = rw.clone()
        calls[f"combine {name}"] = (lambda y=y, h=h, rw=rw: buf.combine(y, h, topk_weights=rw))
    return calls


def _check(C, knobs, checks, reference, failures, label):
    """Run every check under ``knobs`` ({env name: value}); on the default knobs record the reference outputs."""
    for k, v in knobs.items():
        C.set_tuning(k, v)
    ok = True
    for name, fn in checks.items():
        got = _snapshot(fn())
        torch.cuda.synchronize()
        if name not in reference:
            reference[name] = got
        elif not _same(reference[name], got):
            ok = False
            failures.append(f"{label}: {name}")
            print(f"MISMATCH {label}: {name}", flush=True)
    return ok


def _notify_trace(C, buf, x, idx, w, tokens):
    """Per trace point: µs from the earliest block's entry (globaltimer; median over calls of the median over the
    blocks that passed it, and of their latest), and for the last block µs from its own entry by its SM's clock64,
    converted at the rate the globaltimer gives over the calls."""
    P = C.NOTIFY_TRACE_POINTS
    xs, ids, ws = x[:tokens], idx[:tokens], w[:tokens]
    untraced, _ = _kernel_times(lambda: buf.dispatch(xs, topk_idx=ids, topk_weights=ws, num_experts=E), CALLS)
    trace = torch.zeros(C.NOTIFY_TRACE_BLOCKS, P, 2, dtype=torch.int64, device=x.device)
    ctx = buf._backend.nvl.ctx
    ctx.set_notify_trace(trace.data_ptr())
    med, late, clk = [[] for _ in range(P)], [[] for _ in range(P)], [[] for _ in range(P)]
    gt_span = clk_span = 0
    t = None
    try:
        for _ in range(5):
            buf.dispatch(xs, topk_idx=ids, topk_weights=ws, num_experts=E)
        for _ in range(TRACE_CALLS):
            trace.zero_()
            buf.dispatch(xs, topk_idx=ids, topk_weights=ws, num_experts=E)
            torch.cuda.synchronize()
            t = trace.cpu()
            entry = t[:, 0, 0]
            t0 = int(entry[entry > 0].min())
            last = int(t[:, P - 1, 0].argmax())  # the block that wrote the host counts
            for p in range(P):
                col = t[:, p, 0]
                col = col[col > 0]
                if col.numel():
                    us = (col - t0).double() / 1e3
                    med[p].append(float(us.median()))
                    late[p].append(float(us.max()))
                if t[last, p, 1] > 0:
                    clk[p].append(int(t[last, p, 1] - t[last, 0, 1]))
            gt_span += int(t[last, P - 1, 0] - t[last, 0, 0])
            clk_span += int(t[last, P - 1, 1] - t[last, 0, 1])
    finally:
        ctx.set_notify_trace(0)
    ns_per_clk = gt_span / clk_span if clk_span > 0 else 0.0
    rows = []
    for p, name in enumerate(C.NOTIFY_TRACE_NAMES):
        if not med[p]:
            continue
        rows.append({"point": name, "median_us": round(statistics.median(med[p]), 2),
                     "latest_block_us": round(statistics.median(late[p]), 2),
                     "last_block_clock_us": round(statistics.median(clk[p]) * ns_per_clk / 1e3, 2) if clk[p] else None,
                     "blocks": int((t[:, p, 0] > 0).sum())})
    return {"tokens": tokens, "ns_per_clock": round(ns_per_clk, 4), "points": rows,
            "notify_kernel_us_untraced": _kernel_us(untraced, "notify_dispatch"),
            "dispatch_kernel_us_untraced": _kernel_us(untraced, "dc::dispatch_kernel"),
            "fused_kernel_us_untraced": _kernel_us(untraced, "dispatch_fused_kernel")}


def worker(rank, world, hidden, json_path, trace_only=False):
    from deepcomm._ext import load_extension
    C = load_extension()
    dev = torch.device("cuda", rank)
    rows, traces, failures = [], [], []
    knob_names = ("DEEPCOMM_DISPATCH_UNROLL", "DEEPCOMM_DISPATCH_PREFETCH", "DEEPCOMM_DISPATCH_FUSED",
                  "DEEPCOMM_COMBINE_CONFIG")
    start = {k: C.get_tuning(k) for k in knob_names}
    for sms in SMS:
        if trace_only and sms != SMS[-1]:
            continue
        buf, idx, w, x, fp8, h, y = setup_calls(rank, TOKENS, hidden, sms)
        if trace_only:
            for fused in (0, 1):  # the fused launch's notify blocks stamp the same points
                C.set_tuning("DEEPCOMM_DISPATCH_FUSED", fused)
                traces += [dict(_notify_trace(C, buf, x, idx, w, t), fused=fused) for t in TRACE_TOKENS]
            C.set_tuning("DEEPCOMM_DISPATCH_FUSED", start["DEEPCOMM_DISPATCH_FUSED"])
            buf.destroy()
            continue
        timed = {
            "fresh bf16": lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E),
            "fresh fp8": lambda: buf.dispatch(fp8, topk_idx=idx, topk_weights=w, num_experts=E),
            "cached bf16": lambda: buf.dispatch(x, handle=h),
            "cached fp8": lambda: buf.dispatch(fp8, handle=h),
        }
        checks, reference = _dispatch_checks(buf, x, fp8, idx, w, TOKENS), {}
        for unroll, prefetch, fused in DISPATCH_VARIANTS:
            knobs = {"DEEPCOMM_DISPATCH_UNROLL": unroll, "DEEPCOMM_DISPATCH_PREFETCH": prefetch,
                     "DEEPCOMM_DISPATCH_FUSED": fused}
            label = f"dispatch unroll {unroll} prefetch {prefetch} fused {fused} sms {sms}"
            ok = _check(C, knobs, checks, reference, failures, label)
            for case, fn in timed.items():
                kernels, _ = _kernel_times(fn, CALLS)
                rows.append({"kernel": "dispatch", "unroll": unroll, "prefetch": prefetch, "fused": fused,
                             "case": case, "tokens": TOKENS, "num_sms": sms,
                             "dispatch_us": _kernel_us(kernels, "dc::dispatch_kernel"),
                             "fused_us": _kernel_us(kernels, "dc::dispatch_fused_kernel"),
                             "notify_us": _kernel_us(kernels, "notify_dispatch"), "outputs_equal_default": ok,
                             "kernels_us": kernels})
        for k in knob_names[:3]:
            C.set_tuning(k, start[k])
        checks, reference = _combine_checks(buf, x, idx, w, hidden), {}
        for config in COMBINE_CONFIGS:
            label = f"combine config {config} sms {sms}"
            ok = _check(C, {"DEEPCOMM_COMBINE_CONFIG": config}, checks, reference, failures, label)
            kernels, _ = _kernel_times(lambda: buf.combine(y, h), CALLS)
            rows.append({"kernel": "combine", "config": config, "case": "combine bf16", "tokens": TOKENS,
                         "num_sms": sms, "combine_us": _kernel_us(kernels, "::combine_kernel"),
                         "outputs_equal_default": ok, "kernels_us": kernels})
        C.set_tuning("DEEPCOMM_COMBINE_CONFIG", start["DEEPCOMM_COMBINE_CONFIG"])
        if sms == SMS[-1]:
            traces = [_notify_trace(C, buf, x, idx, w, t) for t in TRACE_TOKENS]
        buf.destroy()

    for r in rows:
        what = (f"dispatch unroll {r['unroll']:2d} prefetch {r['prefetch']}" if r["kernel"] == "dispatch"
                else f"combine config {r['config']}")
        us = r.get("dispatch_us", r.get("combine_us"))
        extra = f"  notify {r['notify_us']:6.1f}" if r.get("notify_us") else ""
        print(f"{what:32s} {r['case']:12s} sms {r['num_sms']:3d}  {us:7.1f} us{extra}"
              f"  {'ok' if r['outputs_equal_default'] else 'OUTPUTS DIFFER'}")
    for tr in traces:
        print(f"--- notify trace{', one launch' if tr.get('fused') else ''}, {tr['tokens']} tokens, 24 SMs' "
              "buffer (untraced: notify kernel "
              f"{tr['notify_kernel_us_untraced']} us, dispatch kernel {tr['dispatch_kernel_us_untraced']} us, "
              f"fused kernel {tr['fused_kernel_us_untraced']} us; "
              f"{tr['ns_per_clock']} ns per SM clock): us from the first entry, median over blocks / latest block; "
              "last block by its own clock")
        for p in tr["points"]:
            clk = f"{p['last_block_clock_us']:7.2f}" if p["last_block_clock_us"] is not None else "      -"
            print(f"{p['point']:>28s}: {p['median_us']:7.2f} {p['latest_block_us']:7.2f}  {clk}  "
                  f"({p['blocks']} blocks)")
    if failures:
        print("variants whose outputs differ from the default's:\n  " + "\n  ".join(failures))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"world_size": world, "hidden": hidden, "tokens": TOKENS, "rows": rows, "notify_trace": traces,
                       "failures": failures, "device": torch.cuda.get_device_name(dev),
                       "commit": os.environ.get("DEEPCOMM_COMMIT", "")}, f, indent=1)
    if failures:
        raise AssertionError(f"{len(failures)} variant checks differ from the default's outputs")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--json", default="")
    p.add_argument("--trace-only", action="store_true")
    a = p.parse_args()
    run_on_gpus(worker, 1, a.hidden, a.json, a.trace_only, timeout_s=400)
