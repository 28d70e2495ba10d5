"""Run a worker on every rank: under torchrun (RANK/WORLD_SIZE set) in this process, otherwise by spawning one
process per visible GPU (NCCL) or ``world_size`` CPU processes (gloo). Shared by the bench and the soak."""
from __future__ import annotations

import os
import socket
import sys
import traceback
from typing import Callable

MULTICAST_OFF = (("NCCL_NVLS_ENABLE", "0"), ("NVSHMEM_DISABLE_NVLS", "1"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"))

# worker(rank, world_size, local_rank, args, device_type) -> exit code
Worker = Callable[[int, int, int, object, str], int]


def device_type(choice: str) -> str:
    """"cuda" or "cpu" for ``choice`` in {"auto", "cuda", "cpu"}."""
    import torch

    if choice == "cpu":
        return "cpu"
    has_gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if choice == "cuda" and not has_gpu:
        raise SystemExit("--device cuda: no CUDA device is visible")
    return "cuda" if has_gpu else "cpu"


SHARED_GPU_ENV = "DEEPCOMM_SHARED_GPU"


def ranks_per_gpu(world_size: int, gpus: int) -> int:
    """Ranks on each GPU: 1 while every rank has a GPU of its own; ``world_size`` (all on GPU 0) with
    ``DEEPCOMM_SHARED_GPU=1``; else, with more ranks than GPUs, ranks go round-robin and a GPU holds at most
    ceil(world_size / gpus)."""
    if gpus < 1:
        raise ValueError(f"gpus: expected at least 1, got {gpus}")
    if os.environ.get(SHARED_GPU_ENV, "").strip() not in ("", "0"):
        return world_size
    return -(-world_size // gpus)


def init_rank(rank: int, world_size: int, local_rank: int, dev_type: str):
    """Select the device and join the default process group; returns the torch device. Ranks that share a GPU
    (``ranks_per_gpu`` > 1) join over gloo, since NCCL refuses two ranks on one GPU, and each takes its share of
    the GPU's SMs (deepcomm/gpu_share.py); the CUDA backend then needs ``backend="cuda"`` by name (docs/api.md)."""
    import torch
    import torch.distributed as dist

    if dev_type == "cuda":
        gpus = torch.cuda.device_count()
        sharing = ranks_per_gpu(world_size, gpus)
        index = 0 if sharing == world_size and sharing > 1 else local_rank % gpus
        torch.cuda.set_device(index)
        device, backend = torch.device("cuda", index), "nccl" if sharing == 1 else "gloo"
        if sharing > 1:
            from .gpu_share import GPU_SMS_ENV, sms_per_rank
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            os.environ.setdefault(GPU_SMS_ENV, str(sms_per_rank(sms, sharing)))
            # the ranks share the host's cores as well (a gloo group's reference Buffer works on the CPU)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world_size)
    return device


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(index: int, world_size: int, worker: Worker, args, dev_type: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(index),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(index))
    code = worker(index, world_size, index, args, dev_type)
    if code:
        raise SystemExit(code)


def launch(worker: Worker, args, dev_type: str, world_size: int, name: str) -> int:
    for var, val in MULTICAST_OFF:
        os.environ.setdefault(var, val)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:      # started by torchrun (or mpirun-like env)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return worker(rank, world, int(os.environ.get("LOCAL_RANK", "0")), args, dev_type)
    import torch.multiprocessing as mp

    try:
        mp.spawn(_entry, args=(world_size, worker, args, dev_type, _free_port()), nprocs=world_size, join=True)
    except Exception as e:  # a worker failed: its traceback is in the exception text
        traceback.print_exception(e, limit=0) if not str(e) else print(str(e), file=sys.stderr)
        print(f"{name}: failed ({type(e).__name__})", file=sys.stderr)
        return 1
    return 0
