"""Host cost of the pieces a normal-mode call is made of, each timed alone (median of many calls), at world size
1 on one GPU: the Buffer layer (validation, the fingerprint), the backend's bookkeeping (stream order, the arena,
output views, the handle) and the crossing into C++ alone. A diagnostic for the host path:
`python dev/profile_host_parts.py [--tokens 128] [--json PATH]`."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the repository, for dev.profile_host
from dev.profile_host import setup_calls  # noqa: E402
from tests.helpers.nccl_run import run_on_gpus  # noqa: E402

REPS = 3000


class _IntoProxy:
    """The NVLink context ``real`` (NvlContext) with its dispatch_into replaced by ``into(*args)``: how a profile
    records, replays or times a crossing without touching the backend's code."""

    def __init__(self, real, into):
        self._real, self.dispatch_into = real, into

    def __getattr__(self, name):
        return getattr(self._real, name)


@contextlib.contextmanager
def _fused(C, value: int):
    """DEEPCOMM_DISPATCH_FUSED set to ``value`` inside, back to the default (0) after."""
    C.set_tuning("DEEPCOMM_DISPATCH_FUSED", value)
    try:
        yield
    finally:
        C.set_tuning("DEEPCOMM_DISPATCH_FUSED", 0)


def _median_us(fn, reps=REPS) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    clock = time.perf_counter
    for i in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
        if i % 256 == 255:
            torch.cuda.synchronize()  # launches never queue up behind a full stream
    torch.cuda.synchronize()
    return round(statistics.median(times) * 1e6, 2)


@contextlib.contextmanager
def _reader_off(buf):
    """The Buffer's plain calls through its Python checks and fingerprint instead of the C++ argument reader
    (deepcomm/cuda/arg_reader.py) inside."""
    reader, buf._arg_reader = buf._arg_reader, None
    try:
        yield
    finally:
        buf._arg_reader = reader


def _cases(buf, idx, w, x, fp8, h, y):
    import deepcomm.validation as v
    from deepcomm.nvlink.backend import REPORT_INVALID, WAIT
    from deepcomm import agreement
    from deepcomm.handle import Handle
    from deepcomm.cuda.arena import as_device_bytes
    be = buf._backend
    dev = be.device
    words = agreement.dispatch(1, 1, x, None, None, None, h)
    cwords = agreement.combine(1, 1, y, h, None, False)
    nbytes = be.C.dispatch_out_layout(h.num_recv, x.shape[1] * 2, 0, 0)["total"]
    base = be.arena.base_ptr
    di = be._device_index

    def reserve_release():
        r = be.arena.reserve(nbytes)
        be.arena.release(*r)

    # the views as a dispatch's crossing makes them (ArenaCore.dispatch_views over DispatchOutLayout)
    bf16 = be.arena.dlpack_type(torch.bfloat16)[0]
    n, k = h.num_recv, idx.shape[1]
    three_bytes = be.C.dispatch_out_layout(n, x.shape[1] * 2, 0, k)["total"]

    def one_view():  # a cached BF16 dispatch's output: x
        r = be.arena.reserve(nbytes)
        be.arena.core.dispatch_views(r[0], r[1], True, n, bf16, x.shape[1] * 2, 0, 0, 0, False, False)

    def three_views():  # a fresh BF16 dispatch's outputs: x, topk_idx, topk_weights
        r = be.arena.reserve(three_bytes)
        be.arena.core.dispatch_views(r[0], r[1], True, n, bf16, x.shape[1] * 2, 0, 0, k, True, True)

    # the same views as DLPack capsules handed to torch's importer: a second core over the same memory without the
    # exchange table (deepcomm/cuda/arena.py), for the A/B
    from deepcomm.cuda.arena import ALIGN, _dlpack_importer
    capsule_core = be.C.ArenaCore(base, be.arena.nbytes, ALIGN, be.C.DLPACK_CUDA, di, _dlpack_importer(), None)

    def three_capsule_views():
        r = capsule_core.reserve(three_bytes)
        capsule_core.dispatch_views(r[0], r[1], True, n, bf16, x.shape[1] * 2, 0, 0, k, True, True)

    # the fresh dispatch's crossing alone, replayed with the arguments a real call passed (a new tag each time, so
    # that the host waits for this call's counts); and the same crossing told not to wait (BEGIN | NOTIFY |
    # PAYLOAD | FINISH: the two launches and the views)
    real = be.nvl.ctx
    seen = {}

    def capture(*args):
        seen["into"] = list(args)
        return real.dispatch_into(*args)

    be.nvl.ctx = _IntoProxy(real, capture)
    try:
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=256)
    finally:
        be.nvl.ctx = real
    torch.cuda.synchronize()
    fresh_args = seen["into"]
    # positions in NvlContext.dispatch_into's arguments (csrc/bindings/nvlink.cpp)
    FLAGS, TAG, OUT_ROWS, ALIGN = 8, 20, 28, 30

    def fresh_crossing():
        be._tag += 1
        fresh_args[TAG] = be._tag
        return real.dispatch_into(*fresh_args)

    waits = []

    def fresh_crossing_wait():
        waits.append(fresh_crossing()[6])

    fresh_crossing_wait.waits = waits  # the worker reports their median beside the call's time

    # each layer alone: the Buffer over a backend that returns a real call's outputs at once, and the backend over a
    # crossing that returns a real crossing's result at once (the subtractions of the whole calls)
    fresh_out = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=256)
    fresh_res = fresh_crossing()

    def buffer_layer():
        backend_dispatch, backend_read = be.dispatch, be.dispatch_read
        be.dispatch = be.dispatch_read = lambda *a, **k: fresh_out
        try:
            buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=256)
        finally:
            be.dispatch, be.dispatch_read = backend_dispatch, backend_read

    def python_checks(call):  # the Buffer's Python checks and fingerprint instead of the C++ reader, for the A/B
        with _reader_off(buf):
            return call()

    def backend_python():
        be.nvl.ctx = _IntoProxy(real, lambda *args: fresh_res)
        try:
            be.dispatch(x, idx, w, 256, None, 1, fingerprint=fwords)
        finally:
            be.nvl.ctx = real

    from deepcomm._ext import load_selftest
    S = load_selftest()
    ints = tuple(range(35))

    def knob_pair():  # what switching the launch and back costs (subtract it from the rows that switch)
        be.C.set_tuning("DEEPCOMM_DISPATCH_FUSED", 1)
        be.C.set_tuning("DEEPCOMM_DISPATCH_FUSED", 0)

    def one_launch(call):  # notify and payload in one launch (DEEPCOMM_DISPATCH_FUSED=1), for the A/B
        with _fused(be.C, 1):
            return call()

    def fresh_one_launch():
        one_launch(lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=256))

    no_wait = list(fresh_args)
    no_wait[FLAGS] = (no_wait[FLAGS] & ~WAIT) | REPORT_INVALID  # as a num_worst_tokens dispatch launches
    no_wait[TAG], no_wait[OUT_ROWS], no_wait[ALIGN] = 0, no_wait[2], 1
    fwords = agreement.dispatch(1, 1, x, idx, w, 256, None)
    per_expert = [1] * 256

    def fresh_work():
        T, L = idx.shape[0], 256
        return be._work_layout(T, L, be._capacity_rows)

    return {
        # whole calls
        "buf.dispatch cached bf16": lambda: buf.dispatch(x, handle=h),
        "be.dispatch cached bf16": lambda: be.dispatch(x, None, None, 256, h, 1, fingerprint=words),
        "buf.dispatch fresh bf16": lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=256),
        "buf.dispatch fresh bf16, one launch (+ the knob pair)": fresh_one_launch,
        "buf.dispatch fresh bf16, Python checks": lambda: python_checks(
            lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=256)),
        "fresh dispatch, Buffer layer alone, Python checks": lambda: python_checks(buffer_layer),
        "DispatchArgReader.fresh (checks, fingerprint, reads)": lambda: be.arg_reader.fresh(x, idx, w, 256, 1, 1),
        "buf.dispatch cached bf16, Python checks": lambda: python_checks(lambda: buf.dispatch(x, handle=h)),
        "buf.combine, Python checks": lambda: python_checks(lambda: buf.combine(y, h)),
        "knob pair (set_tuning twice)": knob_pair,
        "fresh crossing, no wait, one launch (+ the knob pair)": lambda: one_launch(
            lambda: real.dispatch_into(*no_wait)),
        "buf.combine": lambda: buf.combine(y, h),
        "be.combine": lambda: be.combine(y, h, None, fingerprint=cwords),
        "be.dispatch fresh bf16": lambda: be.dispatch(x, idx, w, 256, None, 1, fingerprint=fwords),
        # the fresh dispatch's pieces
        "fresh crossing (launches, wait, views)": fresh_crossing_wait,
        "fresh crossing, no wait (launches, views)": lambda: real.dispatch_into(*no_wait),
        "fresh dispatch, Buffer layer alone (backend replayed)": buffer_layer,
        "fresh dispatch, backend Python alone (crossing replayed)": backend_python,
        "pybind no-op, 35 int arguments": lambda: S.noop_35_ints(*ints),
        "pybind no-op, GIL released and taken back": S.noop_gil_release,
        "routing_accepted": lambda: v.routing_accepted(idx, w, idx.shape[0], 256, 1, dev),
        "fresh _work_layout (cached)": fresh_work,
        "torch.empty fresh workspace": lambda: torch.empty(fresh_work()[7], dtype=torch.int32, device=dev),
        "Handle.of_fresh_dispatch": lambda: Handle.of_fresh_dispatch(256, 128, 7168, 128, None, per_expert),
        # Buffer layer pieces
        "check_dispatch_x": lambda: v.check_dispatch_x(x, dev, (torch.bfloat16,), buf.config.hidden,
                                                       buf.config.max_tokens_per_rank),
        "check_topk_idx": lambda: v.check_topk_idx(idx, idx.shape[0], 256, dev, check_values=False),
        "check_topk_weights": lambda: v.check_topk_weights(w, tuple(idx.shape), dev),
        "check_handle": lambda: v.check_handle(h, Handle, buf.buffer_id),
        "check_combine_x": lambda: v.check_combine_x(y, h, dev, (torch.bfloat16,), buf.config.hidden, False),
        "agreement.dispatch (cached)": lambda: agreement.dispatch(1, 1, x, None, None, None, h),
        "agreement.dispatch (fresh)": lambda: agreement.dispatch(1, 1, x, idx, w, 256, None),
        "is_capturing": v.is_capturing,
        # backend pieces
        "be._order plain": lambda: be._order(None, False),
        "be.errors.check": be.errors.check,
        "be._enter_normal": be._enter_normal,
        "arena reserve+release": reserve_release,
        "arena reserve + one bf16 view": one_view,
        "arena reserve + three views": three_views,
        "arena reserve + three views, DLPack capsules": three_capsule_views,
        "raw current stream": lambda: torch._C._cuda_getCurrentRawStream(di),
        "as_tensor (CAI), for comparison": lambda: as_device_bytes(base, 128 * 7168 * 2, dev),
        "torch.empty [128,7168] bf16": lambda: torch.empty(128, 7168, dtype=torch.bfloat16, device=dev),
        "read_error crossing": lambda: be.C.read_error(be.nvl.err_host),
        "x.data_ptr": x.data_ptr,
        "tuple(words)": lambda: tuple(words),
    }


def _crossing_split(buf, idx, w, x, reps=REPS) -> dict:
    """A fresh BF16 dispatch through the Buffer split at the crossing's host stamps (csrc/runtime/host_stamps.hpp)
    and around it: median microseconds per segment, each segment ending at the point it names. The stamps and
    Python's time.monotonic_ns read the same clock; the crossing is wrapped by a proxy (its own cost is in the
    'Python before' segment)."""
    import time as _time
    be = buf._backend
    C, real = be.C, be.nvl.ctx
    names = C.HOST_STAMP_NAMES
    stamps = torch.zeros(len(names), dtype=torch.int64)
    seen = {}
    clock = _time.monotonic_ns

    def stamped(*args):
        seen["pre"] = clock()
        r = real.dispatch_into(*args)
        seen["post"] = clock()
        return r

    labels = (["Python before the crossing"] + [f"crossing: {n}" for n in names] +
              ["crossing: back in Python", "Python after the crossing", "whole call"])
    rows = []
    real.set_host_stamps(stamps.data_ptr())
    be.nvl.ctx = _IntoProxy(real, stamped)
    try:
        for i in range(reps + 50):
            t0 = clock()
            buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=256)
            t1 = clock()
            s = stamps.tolist()
            points = [t0, seen["pre"]] + s + [seen["post"], t1]
            if i >= 50:
                rows.append([b - a for a, b in zip(points, points[1:])] + [t1 - t0])
            if i % 256 == 255:
                torch.cuda.synchronize()
    finally:
        be.nvl.ctx = real
        real.set_host_stamps(0)
    torch.cuda.synchronize()
    return {label: round(statistics.median(r[j] for r in rows) / 1000, 2) for j, label in enumerate(labels)}


def worker(rank, world, tokens, json_path):
    from deepcomm._ext import load_selftest
    buf, idx, w, x, fp8, h, y = setup_calls(rank, tokens, 7168, 24)
    from deepcomm.cuda.arg_reader import exchange_api
    exchange = exchange_api() is not None  # torch's DLPack exchange table: the argument reader and the views use it
    print(f"torch {torch.__version__}: DLPack exchange table {'present' if exchange else 'absent'}")
    out = {}
    for name, fn in _cases(buf, idx, w, x, fp8, h, y).items():
        out[name] = _median_us(fn)
        if hasattr(fn, "waits"):
            out[f"{name}: of which waiting"] = round(statistics.median(fn.waits), 2)
    # the whole call split at the crossing's stamps: the default, the Python checks instead of the C++ reader, then
    # notify and payload as one launch
    for fused, reader, label in ((0, True, "split"), (0, False, "split, Python checks"),
                                 (1, True, "split, one launch")):
        with _fused(buf._backend.C, fused), (contextlib.nullcontext() if reader else _reader_off(buf)):
            out.update({f"{label}: {k}": v for k, v in _crossing_split(buf, idx, w, x).items()})
    # what one launch and one stream-order call cost the host here (csrc/selftest/launch_probe.hpp)
    probe = load_selftest().launch_probe(200, torch.cuda.current_stream().cuda_stream)
    out.update({f"probe: {name}": round(ns / 1000, 2) for name, ns in probe.items()})
    buf.destroy()
    for name, us in out.items():
        print(f"{name:36s} {us:8.2f} us")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"tokens": tokens, "parts_us": out, "device": torch.cuda.get_device_name(0),
                       "torch": torch.__version__, "dlpack_exchange_table": exchange,
                       "commit": os.environ.get("DEEPCOMM_COMMIT", "")}, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--json", default="")
    a = p.parse_args()
    run_on_gpus(worker, 1, a.tokens, a.json, timeout_s=300)
