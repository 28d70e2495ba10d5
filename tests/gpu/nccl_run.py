"""Run a function on N GPU processes (one per GPU, NCCL group); re-raise the first failure in the parent.

Each child gets a hard deadline so a broken kernel fails the test instead of hanging it.
"""
from __future__ import annotations

import os
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world: int, port: int, device: str) -> None:
    """This process joins the test's process group: NCCL on GPU `rank`, or gloo for the runners' own CPU tests."""
    import torch.distributed as dist
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _child(rank, world, port, fn, args, errors, device):
    import torch.distributed as dist
    try:
        try:
            init_group(rank, world, port, device)
        except dist.DistNetworkError:
            # the port _free_port found was taken again before rank 0 could listen on it: the parent retries
            errors.put((rank, _PORT_TAKEN + traceback.format_exc()))
            return
        fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        errors.put((rank, traceback.format_exc()))
        raise


_PORT_TAKEN = "port taken: "


def _launch(ctx, fn, world, args, errors, device):
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, errors, device)) for r in range(world)]
    for p in procs:
        p.start()
    return procs


def run_on_gpus(fn, world: int, *args, timeout_s: float = 300.0, attempts: int = 3, device: str = "cuda") -> None:
    """Runs fn(rank, world, *args) on `world` GPU processes (device="cpu": processes joined by gloo, for the runner's
    own test). A rendezvous port taken between choosing it and listening on it (another process got it first)
    starts the processes again on a new port, up to `attempts` times, within the same `timeout_s`."""
    ctx = mp.get_context("spawn")
    deadline = time.monotonic() + timeout_s
    for attempt in range(attempts):
        errors = ctx.SimpleQueue()
        procs = _launch(ctx, fn, world, args, errors, device)
        first, retry, end = None, False, deadline
        while any(p.is_alive() for p in procs) and time.monotonic() < end and not retry:
            while first is None and not errors.empty():
                rank, tb = errors.get()
                if tb.startswith(_PORT_TAKEN) and attempt + 1 < attempts:
                    retry = True
                    break
                first = (rank, tb)
                end = min(end, time.monotonic() + 10.0)  # the others may be stuck waiting for that rank
            time.sleep(0.05)
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        if retry:
            continue
        if first is None and hung:  # what the killed ranks' peers report afterwards is a consequence, not the cause
            raise AssertionError(f"ranks {hung} did not finish within {timeout_s} s")
        while first is None and not errors.empty():
            first = errors.get()
        if first is not None:
            rank, tb = first
            raise AssertionError(f"rank {rank} failed:\n{tb.removeprefix(_PORT_TAKEN)}")
        bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise AssertionError(f"processes exited with codes {bad}")
        return


def ranks_for_tests() -> int:
    """Ranks of the main correctness tests: DEEPCOMM_TEST_WORLD (e.g. 4 or 8 on a larger machine), default 2,
    never more than the visible GPUs."""
    return max(2, min(int(os.environ.get("DEEPCOMM_TEST_WORLD", "2")), gpu_count()))


def has_nvshmem_wheel() -> bool:
    """The nvidia-nvshmem pip wheel is importable (what the NVSHMEM tests need besides GPUs)."""
    import importlib.util
    try:
        return importlib.util.find_spec("nvidia.nvshmem") is not None
    except ImportError:  # no `nvidia` namespace package at all
        return False


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
