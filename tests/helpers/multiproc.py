"""Run a function in N CPU processes joined by a gloo process group.

``run_ranks(fn, world_size, *args)`` spawns one process per rank, calls ``fn(rank, world_size, *args)`` in
each and returns the per-rank results (pickled by value). The first failing rank's traceback is raised
in the parent at once, and the whole job is killed after ``timeout`` seconds, so a test never hangs.
``fn`` must be a module-level function (spawned processes import it by name).
"""
import datetime
import os
import pickle
import queue
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT = 120.0


def _child(fn, rank, world_size, init_file, args, results, timeout):
    try:
        torch.set_num_threads(1)  # N processes share 2 cores
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        out = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world_size, *args, timeout=DEFAULT_TIMEOUT):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")   # a file store: no port to pick, no collision between tests
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, init_file, args, results, timeout),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        done = {}
        deadline = time.monotonic() + timeout
        try:
            while len(done) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(world_size)) - set(done))
                    raise TimeoutError(f"{fn.__name__}: ranks {missing} did not finish within {timeout:.0f} s")
                try:
                    rank, ok, payload = results.get(timeout=min(left, 0.5))
                except queue.Empty:
                    for r, p in enumerate(procs):
                        if r not in done and p.exitcode not in (None, 0):
                            raise RuntimeError(f"{fn.__name__}: rank {r} died with exit code {p.exitcode}")
                    continue
                if not ok:
                    raise RuntimeError(f"{fn.__name__}: rank {rank} of {world_size} failed:\n{payload}")
                done[rank] = pickle.loads(payload)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
    return [done[r] for r in range(world_size)]
