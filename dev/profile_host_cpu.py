"""Host cost of the NVLink backend's normal-mode Python, on a CPU box: the backend of tests/helpers/nvl_stand_ins.py
(its crossing into C++ a recorded stand-in, its arena the C++ core's over host memory), alone and behind a
Buffer (world size 1 over gloo), timed per call (median). It measures what changes in the Python of a call (the
Buffer's checks and fingerprint, the stream order, the arena, the handle), not the GPU host's absolute times, which
dev/profile_host.py and dev/profile_host_parts.py take on a GPU: `python dev/profile_host_cpu.py [--json PATH]`."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the repository, for tests.helpers
from tests.helpers.nvl_stand_ins import C, Patches, cpu_backend, put_behind_buffer  # noqa: E402

REPS = 20000


def _buffer_over(backend):
    """A Buffer of world size 1 (a gloo group of this process) whose backend is ``backend``: the Buffer layer's
    checks, fingerprint and numbering in front of the stand-in backend."""
    import socket
    import torch.distributed as dist
    import deepcomm
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    buf = deepcomm.Buffer(max_tokens_per_rank=256, hidden=1024, backend="reference")
    put_behind_buffer(buf, backend)
    return buf


def _median_us(fn, reps=REPS) -> float:
    for _ in range(200):
        fn()
    times = []
    clock = time.perf_counter
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return round(statistics.median(times) * 1e6, 2)


def main(json_path: str) -> None:
    from deepcomm import agreement
    from deepcomm import validation as v
    patches = Patches()
    try:
        state = cpu_backend(patches.setattr)
        b, ctx = state.b, state.ctx
        T, H, K, E = 128, 1024, 8, 8
        x = torch.zeros(T, H, dtype=torch.bfloat16)
        idx = torch.zeros(T, K, dtype=torch.int64)
        w = torch.zeros(T, K)
        words = agreement.dispatch(1, 1, x, idx, w, E, None)
        *_, h = b.dispatch(x, idx, w, E, None, 1, fingerprint=words)
        cached_words = agreement.dispatch(1, 1, x, None, None, None, h)
        combine_words = agreement.combine(1, 1, x, h, None, False)
        dev = torch.device("cpu")

        def fresh():
            ctx.calls.clear()
            b.dispatch(x, idx, w, E, None, 1, fingerprint=words)

        def cached():
            ctx.calls.clear()
            b.dispatch(x, None, None, E, h, 1, fingerprint=cached_words)

        def combine():
            ctx.combines.clear()
            b.combine(x, h, None, fingerprint=combine_words)

        def fake_crossing():  # what a cached dispatch's crossing costs the stand-in (reserve, record, views)
            ctx.calls.clear()
            ctx.dispatch_into(b.arena.core, b._arena_at, T, b._types[torch.bfloat16][0], 0, False, False, 0, 1, 2, 3,
                              4, 5, 0, T, 0,
                              E, 0, 0, 0, 0, 0, 2 * H, 0, 0, 0, 0, 0, T, 24, 1, 0, 1.0, cached_words)

        buf = _buffer_over(b)
        bh = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)[-1]

        def buf_fresh():
            ctx.calls.clear()
            buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)

        def python_checks(call):  # the Buffer's Python checks instead of the C++ argument reader
            def run():
                reader, buf._arg_reader = buf._arg_reader, None
                try:
                    call()
                finally:
                    buf._arg_reader = reader
            return run

        def buf_cached():
            ctx.calls.clear()
            buf.dispatch(x, handle=bh)

        def buf_combine():
            ctx.combines.clear()
            buf.combine(x, bh)

        cases = {
            "Buffer.dispatch fresh (bf16, ids, weights)": buf_fresh,
            "Buffer.dispatch fresh, Python checks": python_checks(buf_fresh),
            "Buffer.dispatch cached (bf16)": buf_cached,
            "Buffer.dispatch cached, Python checks": python_checks(buf_cached),
            "Buffer.combine": buf_combine,
            "Buffer.combine, Python checks": python_checks(buf_combine),
            "backend fresh dispatch (bf16, ids, weights)": fresh,
            "backend cached dispatch (bf16)": cached,
            "backend combine": combine,
            "  of which the stand-in crossing (subtract)": fake_crossing,
            "check_dispatch_x": lambda: v.check_dispatch_x(x, dev, (torch.bfloat16,), H, 256),
            "agreement.dispatch (fresh)": lambda: agreement.dispatch(1, 1, x, idx, w, E, None),
            "DispatchArgReader.fresh": lambda: b.arg_reader.fresh(x, idx, w, E, 1, 1),
            "agreement.combine": lambda: agreement.combine(1, 1, x, h, None, False),
            "backend _order (plain call)": lambda: b._order(None, False),
        }
        out = {name: _median_us(fn) for name, fn in cases.items()}
    finally:
        patches.undo()
    for name, us in out.items():
        print(f"{name:46s} {us:8.2f} us")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"host_us": out, "python": sys.version.split()[0], "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default="")
    a = p.parse_args()
    if C is None:
        sys.exit("deepcomm._C is not built: the stand-ins need its layouts and flags")
    main(a.json)
