"""What a few SMs reach when they copy rows, by each means a dispatch or combine kernel could use: 16-byte vector
loads and stores (with and without the L2's 256-byte fetch hint, at several vectors in flight per lane), bulk
copies through shared memory (producers per SM, chunk slots each, chunk size), and bulk loads read back by every
lane (the bulk reducers' pattern), at 4-32 SMs, beside cudaMemcpyAsync
of the same bytes. The rows are a DeepSeek-V3 BF16 dispatch's at world size 1 (4096 x 7168 x 2 bytes), from one
buffer of this GPU to another: the copy apart from any link. Each variant's bytes are checked before it is timed.
`python dev/profile_copy.py [--sms 4,8,16,24,32] [--json PATH]`, one GPU."""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

REPS = 20
# name -> the probe's arguments (csrc/selftest/copy_probe.hpp)
VARIANTS = {
    "vectors u8": dict(kind="vectors", unroll=8),
    "vectors u16": dict(kind="vectors", unroll=16),
    "vectors u8 l2-256": dict(kind="vectors", unroll=8, l2_hint=True),
    "vectors u4 1024 threads": dict(kind="vectors", unroll=4, threads=1024),
    "vectors u8 1024 threads": dict(kind="vectors", unroll=8, threads=1024),
    "vectors u4 256 threads": dict(kind="vectors", unroll=4, threads=256),
    "bulk 1 producer x 8 rows": dict(kind="bulk", producers=1, slots=8),
    "bulk 1 producer x 14 rows": dict(kind="bulk", producers=1, slots=14),
    "bulk 2 producers x 7 rows": dict(kind="bulk", producers=2, slots=7),
    "bulk 4 producers x 4 rows": dict(kind="bulk", producers=4, slots=4),
    "bulk 8 producers x 4 x 7168 B": dict(kind="bulk", producers=8, slots=4, chunk=7168),
    "bulk 16 producers x 3 x 3584 B": dict(kind="bulk", producers=16, slots=3, chunk=3584),
    "ring 8 warps x 6 x 3584 B": dict(kind="ring", producers=8, slots=6, chunk=3584),
    "ring 8 warps x 6 x 3584 B, lane 0 waits": dict(kind="ring", producers=8, slots=6, chunk=3584, lane0_waits=True),
    "ring 16 warps x 3 x 3584 B": dict(kind="ring", producers=16, slots=3, chunk=3584),
    "ring 4 warps x 12 x 3584 B": dict(kind="ring", producers=4, slots=12, chunk=3584),
    "ring 8 warps x 2 x 14336 B": dict(kind="ring", producers=8, slots=2, chunk=14336),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sms", default="4,8,16,24,32")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--row-bytes", type=int, default=7168 * 2)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from deepcomm._ext import load_selftest, selftest_error
    S = load_selftest()
    if S is None:
        raise SystemExit(f"deepcomm._selftest is not available ({selftest_error()})")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    nbytes = args.rows * args.row_bytes
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    stream = torch.cuda.current_stream(dev).cuda_stream

    def run(spec, sms):
        kw = dict(spec)
        kind = kw.pop("kind")
        S.copy_probe(kind, src.data_ptr(), dst.data_ptr(), args.rows, args.row_bytes, sms, stream, **kw)

    def time_us(name, spec, sms):
        dst.zero_()
        run(spec, sms)
        if not torch.equal(src, dst):
            raise SystemExit(f"{name} at {sms} SMs: the copy differs from its source")
        times = []
        for _ in range(REPS):
            flush.zero_()  # the source out of L2, as a dispatch's input usually is
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run(spec, sms)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000.0)
        return statistics.median(times)

    results = []
    memcpy_us = time_us("memcpy", dict(kind="memcpy"), 1)
    print(f"{nbytes / 1e6:.1f} MB per copy; cudaMemcpyAsync {memcpy_us:.1f} us ({nbytes / memcpy_us / 1e3:.0f} GB/s)")
    results.append({"variant": "cudaMemcpyAsync", "sms": None, "us": round(memcpy_us, 1),
                    "gbps": round(nbytes / memcpy_us / 1e3, 1)})
    sms_list = [int(s) for s in args.sms.split(",")]
    print(f"{'variant':34s}" + "".join(f"{s:>8d} SMs GB/s (per SM)" for s in sms_list))
    for name, spec in VARIANTS.items():
        line = f"{name:34s}"
        for sms in sms_list:
            us = time_us(name, spec, sms)
            gbps = nbytes / us / 1e3
            line += f"{us:9.1f} us {gbps:6.0f} ({gbps / sms:5.1f})"
            results.append({"variant": name, "sms": sms, "us": round(us, 1), "gbps": round(gbps, 1),
                            "gbps_per_sm": round(gbps / sms, 1)})
        print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "commit": os.environ.get("DEEPCOMM_COMMIT", ""),
                       "rows": args.rows, "row_bytes": args.row_bytes, "reps": REPS,
                       "gbps": "bytes copied (read once, written once) / time", "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
