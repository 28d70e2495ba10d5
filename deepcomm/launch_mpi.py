"""Start torch.distributed from MPI, then run a module or script: the bootstrap behind launch/mpirun.sh.

    mpirun -np 16 --hostfile hosts python -m deepcomm.launch_mpi -m deepcomm.bench --json out.json
    mpirun -np 2 python -m deepcomm.launch_mpi examples/train_moe.py --steps 100

Every process learns its rank and the world size from ``MPI.COMM_WORLD`` (mpi4py), its local rank from the
node-local communicator (``COMM_TYPE_SHARED``), and the rendezvous address from rank 0, which broadcasts its
address (``MASTER_ADDR`` if set, else the IP its hostname resolves to) and a free port (``--master-port`` /
``MASTER_PORT``, else one it picks). It then exports the torchrun variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), selects GPU ``LOCAL_RANK`` when there are
GPUs, initialises the default process group (NCCL on GPUs, gloo otherwise; ``--backend``) and runs the target
with ``runpy`` as ``__main__``. Targets that call ``init_process_group`` only when ``not dist.is_initialized()``
(deepcomm.bench, examples/train_moe.py) reuse that group; others still see the torchrun variables.
With ``DEEPCOMM_LL_MEMORY=nvshmem`` and GPUs, NVSHMEM is bootstrapped through MPI as well (its unique id sent with
``comm.bcast``; PE = MPI rank = torch.distributed rank), and finalized after a target that exits cleanly.
"""
from __future__ import annotations

import argparse
import datetime
import os
import runpy
import socket
import sys
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .config import resolve_low_latency_memory
from .gpu_share import GPU_SMS_ENV, sms_per_rank
from .local_launch import ranks_per_gpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _my_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def rendezvous(comm, master_port: Optional[int] = None) -> Tuple[int, int, int, int, str, int]:
    """``(rank, world, local_rank, local_world, master_addr, master_port)`` from an mpi4py communicator (any object
    with ``Get_rank``, ``Get_size``, ``bcast`` and ``Split_type``); rank 0 chooses the address and port."""
    rank, world = comm.Get_rank(), comm.Get_size()
    try:
        from mpi4py import MPI
        split_type = MPI.COMM_TYPE_SHARED
    except ImportError:  # a stand-in communicator (tests)
        split_type = 0
    local = comm.Split_type(split_type, key=rank)
    local_rank, local_world = local.Get_rank(), local.Get_size()
    ours = None
    if rank == 0:
        addr = os.environ.get("MASTER_ADDR") or _my_address()
        port = master_port or int(os.environ.get("MASTER_PORT", "0")) or _free_port()
        ours = (addr, port)
    addr, port = comm.bcast(ours, root=0)
    return rank, world, local_rank, local_world, addr, int(port)


def init_from_mpi(comm=None, backend: str = "auto", master_port: Optional[int] = None,
                  timeout_s: float = 600.0) -> Tuple[int, int, int]:
    """Export the torchrun variables and initialise the default process group; returns ``(rank, world, local_rank)``.
    ``comm`` defaults to ``mpi4py.MPI.COMM_WORLD``."""
    if comm is None:
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise RuntimeError("deepcomm.launch_mpi needs mpi4py (pip install mpi4py) and an MPI launcher") from exc
        comm = MPI.COMM_WORLD
    rank, world, local_rank, local_world, addr, port = rendezvous(comm, master_port)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(local_world), MASTER_ADDR=addr, MASTER_PORT=str(port))
    use_cuda = torch.cuda.is_available() and backend in ("auto", "nccl")
    # more ranks on this host than GPUs: they share GPUs, which NCCL refuses, so "auto" takes gloo
    sharing = ranks_per_gpu(local_world, torch.cuda.device_count()) if use_cuda else 1
    if backend == "auto":
        backend = "nccl" if use_cuda and sharing == 1 else "gloo"
    kwargs = {}
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        if sharing > 1:  # each rank's share of its GPU's SMs (deepcomm/gpu_share.py)
            sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            os.environ.setdefault(GPU_SMS_ENV, str(sms_per_rank(sms, sharing)))
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    if use_cuda and resolve_low_latency_memory(None) == "nvshmem":
        from .cuda import nvshmem_session
        nvshmem_session.init_with_mpi(comm, torch.cuda.current_device())
    return rank, world, local_rank


def run_target(target: Sequence[str]) -> None:
    """Run ``-m MODULE args...`` or ``SCRIPT args...`` as ``__main__`` with ``sys.argv`` set like python would."""
    target = list(target)
    if not target:
        raise SystemExit("deepcomm.launch_mpi: give -m MODULE or a script to run")
    old_argv = sys.argv
    try:
        if target[0] == "-m":
            if len(target) < 2:
                raise SystemExit("deepcomm.launch_mpi: -m needs a module name")
            sys.argv = [target[1]] + target[2:]
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = target
            sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
            runpy.run_path(target[0], run_name="__main__")
    finally:
        sys.argv = old_argv


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


_OPTIONS_WITH_VALUE = ("--backend", "--master-port", "--timeout")


def _split(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """Our options, then the target (from the first token that is not one of them: ``-m``, ``--``, a script)."""
    argv = list(argv)
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in _OPTIONS_WITH_VALUE:
            i += 2
        elif a.startswith(tuple(o + "=" for o in _OPTIONS_WITH_VALUE)) or a in ("-h", "--help"):
            i += 1
        else:
            break
    head, target = argv[:i], argv[i:]
    return head, target[1:] if target[:1] == ["--"] else target


def main(argv: Optional[List[str]] = None, comm=None) -> int:
    p = argparse.ArgumentParser(prog="python -m deepcomm.launch_mpi",
                                usage="%(prog)s [options] (-m MODULE | SCRIPT) [args...]",
                                description="Initialise torch.distributed from MPI, then run a module or script.")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                   help="process-group backend (auto: nccl with GPUs, else gloo)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: MASTER_PORT or free)")
    p.add_argument("--timeout", type=float, default=600.0, help="process-group timeout in seconds")
    head, target = _split(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(head)
    if not target:
        p.error("give -m MODULE or a script to run")
    init_from_mpi(comm, args.backend, args.master_port, args.timeout)
    code = 1  # stays 1 when the target raises
    try:
        run_target(target)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    finally:
        nvshmem = sys.modules.get("deepcomm.cuda.nvshmem_session")
        if code == 0 and nvshmem is not None and nvshmem.is_initialized():
            nvshmem.finalize()  # collective; after a failure the other ranks may never arrive, so skipped then
        if dist.is_initialized():
            dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
