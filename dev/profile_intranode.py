"""Where the time of one normal-mode dispatch/combine goes: host time per call, and device time per kernel
(torch.profiler). A diagnostic for kernel work, not the benchmark: `python dev/profile_intranode.py`."""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the repository, for tests.helpers
from tests.helpers.nccl_run import run_on_gpus  # noqa: E402


def _timed(fn, iters=30, wait_for_device=True):
    """Host microseconds per call; with ``wait_for_device=False`` only the launch side (the device catches up
    after the clock stops)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if wait_for_device:
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - t0) / iters * 1e6
    torch.cuda.synchronize()
    return elapsed


def worker(rank, world, tokens, hidden, num_sms):
    from profile_host import setup_calls  # dev/ is this script's directory
    buf, idx, w, x, fp8, h, y = setup_calls(rank, tokens, hidden, num_sms)
    res = {
        "fresh bf16": _timed(lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=256)),
        "fresh fp8": _timed(lambda: buf.dispatch(fp8, topk_idx=idx, topk_weights=w, num_experts=256)),
        "cached bf16": _timed(lambda: buf.dispatch(x, handle=h)),
        "cached fp8": _timed(lambda: buf.dispatch(fp8, handle=h)),
        "combine": _timed(lambda: buf.combine(y, h)),
        "layout": _timed(lambda: buf.get_dispatch_layout(idx, 256)),
    }
    dist.barrier()
    if os.environ.get("PROFILE_TABLE", "1") != "1":
        if rank == 0:
            print(f"combine config {os.environ.get('DEEPCOMM_COMBINE_CONFIG', 'default')} sms {num_sms}: " +
                  " ".join(f"{k}={v:.1f}" for k, v in res.items()), flush=True)
        buf.destroy()
        return
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=256)
            buf.dispatch(fp8, handle=h)
            buf.combine(y, h)
        torch.cuda.synchronize()
    if rank == 0:
        print(f"tokens {tokens} hidden {hidden} num_sms {num_sms}: host-timed us per call")
        for k, v in res.items():
            print(f"  {k:12s} {v:9.1f}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18))
    buf.destroy()


if __name__ == "__main__":
    tokens = int(os.environ.get("TOKENS", 4096))
    configs = os.environ.get("COMBINE_CONFIGS", "")
    if configs:  # compare kernel instantiations, host timings only
        os.environ["PROFILE_TABLE"] = "0"
        for cfg in configs.split(","):
            os.environ["DEEPCOMM_COMBINE_CONFIG"] = cfg
            for sms in (24, 8):
                run_on_gpus(worker, 2, tokens, 7168, sms)
    else:
        for sms in (24, 8):
            run_on_gpus(worker, 2, tokens, 7168, sms)
