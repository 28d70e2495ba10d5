"""Run a function on N GPU processes (one per GPU, NCCL group); re-raise the first failure in the parent.

Each child gets a hard deadline so a broken kernel fails the test instead of hanging it.
"""
from __future__ import annotations

import os
import socket
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


def _child(rank, world, port, fn, args, errors):
    import torch.distributed as dist
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
        fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        errors.put((rank, traceback.format_exc()))
        raise


def run_on_gpus(fn, world: int, *args, timeout_s: float = 300.0) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout_s} s")
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"processes exited with codes {bad}")


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
