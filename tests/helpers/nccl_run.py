"""Run a function on N GPU processes (one per GPU, NCCL group); re-raise the first failure in the parent.

Each child gets a hard deadline so a broken kernel fails the test instead of hanging it.

Shared mode (``DEEPCOMM_TEST_SHARED_GPU=1``, docs/testing.md): every rank runs on GPU 0, under MPS when its control
daemon runs (launch/with_mps.sh), joined by gloo (NCCL refuses two ranks on one GPU); each rank gets its share of
the SMs (``DEEPCOMM_GPU_SMS``, deepcomm/gpu_share.py), so the kernels' waiting blocks of all ranks fit on the GPU
at once. ``DEEPCOMM_TEST_WORLD`` sets the ranks of the main correctness tests in either mode. The helpers below
(``rank_device``, ``sms``, ``reference``, ``cuda_buffer``, ``needs_ranks``, ``scaled``) make one test serve both.
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


def shared_gpu() -> bool:
    """Shared mode: every rank of a test on GPU 0, over gloo (``DEEPCOMM_TEST_SHARED_GPU=1``)."""
    return os.environ.get("DEEPCOMM_TEST_SHARED_GPU", "").strip() not in ("", "0")


def shared_sms(world: int, sm_count: int) -> int:
    """Each rank's SMs in shared mode: an equal share of GPU 0's ``sm_count`` (deepcomm.gpu_share.sms_per_rank),
    so that the waiting blocks of every rank's kernels fit on the GPU together."""
    from deepcomm.gpu_share import sms_per_rank
    return sms_per_rank(sm_count, world)


def init_group(rank: int, world: int, port: int, device: str) -> None:
    """This process joins the test's process group: NCCL on GPU `rank`; in shared mode gloo, every rank on GPU 0
    with its share of the SMs; or gloo for the runners' own CPU tests."""
    import torch.distributed as dist
    if device == "cuda" and shared_gpu():
        from deepcomm.gpu_share import GPU_SMS_ENV
        torch.cuda.set_device(0)
        sm_count = torch.cuda.get_device_properties(0).multi_processor_count
        os.environ[GPU_SMS_ENV] = str(shared_sms(world, sm_count))
        # the host's cores shared too: torch's CPU threads (the reference runs on the CPU here) would each spin on
        # every core
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    elif device == "cuda":
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
        except RuntimeError as e:
            # under MPS the server answers "busy or unavailable" for a moment while it lets the clients of a
            # finished test go: the parent starts the ranks again (torch.AcceleratorError is a RuntimeError)
            if not (shared_gpu() and "busy or unavailable" in str(e)):
                raise
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
    starts the processes again on a new port, up to `attempts` times, within the same `timeout_s`; so does a GPU
    that MPS reports busy at start-up (shared mode)."""
    ctx = mp.get_context("spawn")
    if device == "cuda":
        timeout_s = scaled(timeout_s)
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
            time.sleep(1.0)
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


def requested_world() -> int:
    """DEEPCOMM_TEST_WORLD (default 2); ValueError names the variable."""
    env = os.environ.get("DEEPCOMM_TEST_WORLD", "2").strip() or "2"
    if not env.isdigit() or int(env) < 2:
        raise ValueError(f"DEEPCOMM_TEST_WORLD: expected an integer of at least 2, got {env!r}")
    return int(env)


def ranks_for_tests() -> int:
    """Ranks of the main correctness tests: DEEPCOMM_TEST_WORLD (e.g. 4 or 8), default 2; never more than the
    visible GPUs, except in shared mode, where every rank runs on GPU 0."""
    world = requested_world()
    return world if shared_gpu() else max(2, min(world, gpu_count()))


def can_run(world: int) -> bool:
    """A test of ``world`` ranks can run here: one GPU per rank, or shared mode with a GPU and at most
    DEEPCOMM_TEST_WORLD ranks (a shared run at 2 ranks leaves the 4- and 8-rank topologies to runs that ask)."""
    if shared_gpu():
        return gpu_count() >= 1 and world <= requested_world()
    return gpu_count() >= world


def needs_ranks(world: int, what: str = ""):
    """A skip mark for a test of ``world`` ranks that cannot run here (``can_run``)."""
    import pytest
    why = (f"{what or f'{world} ranks'} needs {world} GPUs, or shared mode (DEEPCOMM_TEST_SHARED_GPU=1) with "
           f"DEEPCOMM_TEST_WORLD >= {world}")
    return pytest.mark.skipif(not can_run(world), reason=why)


def rank_device(rank: int) -> torch.device:
    """Rank ``rank``'s GPU: its own, or GPU 0 in shared mode."""
    return torch.device("cuda", 0 if shared_gpu() else rank)


def sms(n: int) -> int:
    """``n`` communication SMs, or this rank's share of GPU 0 where that is less (shared mode; call in a worker)."""
    from deepcomm.gpu_share import usable_sms
    return min(n, usable_sms(torch.device("cuda", torch.cuda.current_device())))


def scaled(timeout_s: float) -> float:
    """A test's wall-clock deadline, longer in shared mode: its ranks start, build and run side by side on one GPU
    (about half again per two ranks past two)."""
    if not shared_gpu():
        return timeout_s
    return timeout_s * max(1.0, requested_world() / 2)


def cuda_buffer(**kwargs):
    """A Buffer on the CUDA backend (call in a worker); ``num_sms`` within this rank's share of the GPU."""
    import deepcomm
    if "num_sms" in kwargs:
        kwargs["num_sms"] = sms(kwargs["num_sms"])
    return deepcomm.Buffer(backend="cuda", **kwargs)


def reference(dev: torch.device, **kwargs):
    """The reference Buffer of a test, answering in tensors on ``dev``: on an NCCL group it lives there; on the
    gloo group of shared mode it runs on the CPU and the adapter (deepcomm/reference/device_adapter.py) moves its
    inputs there and its outputs back."""
    import deepcomm
    from deepcomm.reference.device_adapter import DeviceAdapter
    return DeviceAdapter(deepcomm.Buffer(backend="reference", **kwargs), dev)


def has_nvshmem_wheel() -> bool:
    """The nvidia-nvshmem pip wheel is importable (what the NVSHMEM tests need besides GPUs)."""
    import importlib.util
    try:
        return importlib.util.find_spec("nvidia.nvshmem") is not None
    except ImportError:  # no `nvidia` namespace package at all
        return False


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
