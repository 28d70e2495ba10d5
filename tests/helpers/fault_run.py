"""Run a fault-injection worker on N GPU processes, where some ranks are meant to die mid-run.

``nccl_run.run_on_gpus`` wants every rank to finish cleanly (it ends with a barrier). Here a rank listed in
``killed`` is expected to end itself (``die()``: SIGKILL, no cleanup), and the survivors must not touch the process
group after that: a collective with a dead peer can block far longer than any deadline. So each survivor reports
its verdict on a queue and leaves with ``os._exit``, skipping process-group teardown. A deadline kills stragglers
and fails the test: a survivor still running at the deadline is a hang.
"""
from __future__ import annotations

import os
import signal
import time
import traceback

import torch.multiprocessing as mp

from tests.helpers.nccl_run import _free_port, init_group, scaled


def die() -> None:
    """End this process at once, as a crash or an OOM kill would: no Python, CUDA or NCCL teardown."""
    os.kill(os.getpid(), signal.SIGKILL)


def _child(rank, world, port, fn, args, results, device):
    # What torch's NCCL watchdog does about a dead peer (it may end the process) is not under test here: deepcomm's
    # own report is. The survivors run no collective after the fault anyway.
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    verdict = ("ok", "")
    try:
        init_group(rank, world, port, device)
        fn(rank, world, *args)
    except BaseException:  # noqa: BLE001 - every failure goes to the parent
        verdict = ("error", traceback.format_exc())
    results.put((rank,) + verdict)  # SimpleQueue writes straight to the pipe: safe to _exit right after
    os._exit(0)


def run_with_faults(fn, world: int, *args, killed=(), deadline_s: float = 120.0, device: str = "cuda") -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` GPUs (NCCL; ``device="cpu"``: processes joined by gloo). Ranks in
    ``killed`` must die (no verdict, exit by SIGKILL); every other rank must return from ``fn`` without an exception
    before ``deadline_s``. Raises AssertionError listing every rank that did otherwise."""
    ctx = mp.get_context("spawn")
    if device == "cuda":
        deadline_s = scaled(deadline_s)  # shared mode: ranks start and run side by side on one GPU
    results = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, results, device)) for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    verdicts = {}
    while not results.empty():
        rank, status, detail = results.get()
        verdicts[rank] = (status, detail)
    problems = []
    for r, p in enumerate(procs):
        if r in hung:
            problems.append(f"rank {r} was still running after {deadline_s} s (a hang)")
        elif r in killed:
            if r in verdicts or p.exitcode != -signal.SIGKILL:
                problems.append(f"rank {r} was to be killed but ended with {verdicts.get(r, ('no verdict',))[0]}, "
                                f"exit code {p.exitcode}")
        elif r not in verdicts:
            problems.append(f"rank {r} died without a verdict (exit code {p.exitcode})")
        elif verdicts[r][0] != "ok":
            problems.append(f"rank {r} failed:\n{verdicts[r][1]}")
    if problems:
        raise AssertionError("\n".join(problems))
