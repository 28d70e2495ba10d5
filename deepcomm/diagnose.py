"""``python -m deepcomm``: what this machine gives deepcomm, and what each backend and transport would do here.

Local checks only: no process group is made, nothing is allocated on a GPU and no NVSHMEM library is opened.
What needs the ranks of a job (host names, the process group's backend) is said as a condition.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from typing import List, Optional

import torch

from ._ext import extension_error, load_extension
from ._version import __version__
from .backends import cuda_unavailable_reason


def build_info(C) -> dict:
    """The extension's build: ``deepcomm/_build_info.json`` written by setup.py, else the CUDA arch read from the
    link line nvcc records in the library (``-arch sm_NN``); {} without the extension."""
    if C is None:
        return {}
    path = os.path.join(os.path.dirname(C.__file__), "_build_info.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    with open(C.__file__, "rb") as f:
        found = sorted(set(re.findall(rb"-arch (sm_\d+a?)\b", f.read())))
    return {"cuda_arch": ", ".join(a.decode() for a in found) or None}


def nvshmem_status(C) -> tuple:
    """``(compiled_in, library_path_or_None, why_not_or_None)`` without opening the library."""
    from .cuda.nvshmem_library import INSTALL_HINT, LIB_NAME, library_candidates
    if C is None:
        return False, None, "needs the extension"
    if getattr(C, "nvshmem", None) is None:
        return False, None, getattr(C, "NVSHMEM_MISSING", "the extension was built without NVSHMEM headers")
    found = [p for p in library_candidates() if p != LIB_NAME]
    if found:
        return True, found[0], None
    return True, None, f"{LIB_NAME} not in $NVSHMEM_HOME/lib or the nvidia-nvshmem wheel ({INSTALL_HINT})"


def exchange_table_line(C) -> str:
    """Whether plain normal-mode calls are checked and read in C++: it needs torch's DLPack exchange table
    (deepcomm/cuda/arg_reader.py); without it they take the Python checks, which cost more host time."""
    from .cuda.arg_reader import dispatch_arg_reader
    if dispatch_arg_reader(C, 1, -1, 8, 1) is None:
        return ("plain calls' arguments: read by the Python checks (this torch has no usable DLPack exchange table, "
                "torch.Tensor.__dlpack_c_exchange_api__: torch 2.10 or later has one)")
    return "plain calls' arguments: read in C++ through torch's DLPack exchange table"


def gpu_lines() -> List[str]:
    if not torch.cuda.is_available():
        return ["GPUs: none visible to torch (CUDA is not available)"]
    n = torch.cuda.device_count()
    lines = [f"GPUs: {n}"]
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"  cuda:{i} {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                     f"{p.total_memory / 2**30:.0f} GiB")
    if n > 1:
        lines.append("  peer access (row can read/write column's memory):")
        lines.append("        " + " ".join(f"{j:>4}" for j in range(n)))
        for i in range(n):
            cells = ["   -" if i == j else ("  ok" if torch.cuda.can_device_access_peer(i, j) else "  no")
                     for j in range(n)]
            lines.append(f"    {i:>3} " + " ".join(cells))
    return lines


def nvidia_smi_topology() -> Optional[str]:
    """``nvidia-smi topo -m`` (the links: NV18 = 18 NVLinks, SYS/PHB = PCIe), when nvidia-smi is there."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.rstrip() if out.returncode == 0 else None


def backend_lines(C) -> List[str]:
    cuda_reason = cuda_unavailable_reason()
    nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    if cuda_reason is None and not nccl:
        cuda_reason = "this torch has no NCCL (the CUDA backend needs an NCCL process group)"
    peers_ok = True
    if cuda_reason is None and torch.cuda.device_count() > 1:
        n = torch.cuda.device_count()
        peers_ok = all(torch.cuda.can_device_access_peer(i, j) for i in range(n) for j in range(n) if i != j)
    lines = ["backends (Buffer(backend=...)):",
             "  reference: available (pure PyTorch on torch.distributed, any device, any process-group backend; "
             "the oracle the kernels are tested against, not fast)"]
    if cuda_reason is None:
        extra = "" if peers_ok else ("; some GPU pairs lack peer access: ranks on this host must be on GPUs that "
                                     "can map each other's memory")
        lines.append(f"  cuda: available with an NCCL process group, one GPU per rank{extra}")
        lines.append("  auto: picks cuda on an NCCL group; on a gloo group, the reference backend")
    else:
        lines.append(f"  cuda: not here: {cuda_reason}")
        lines.append("  auto: picks the reference backend here" +
                     (" and warns, since CUDA is present" if torch.cuda.is_available() else ""))
    compiled, lib, why = nvshmem_status(C)
    lines.append("internode transports (several nodes: Buffer(gpus_per_node=...) or DEEPCOMM_GPUS_PER_NODE):")
    if cuda_reason is None:
        lines.append("  emulated: available for one host posing as several nodes (GPU-posted mlx5 WQEs executed "
                     "by the device emulated NIC); ranks on several hosts need nvshmem")
    else:
        lines.append(f"  emulated: not here: {cuda_reason}")
    if cuda_reason is not None:
        lines.append(f"  nvshmem: not here: {cuda_reason}")
    elif lib is not None:
        lines.append(f"  nvshmem: available (NVSHMEM host library {lib}); reaches other hosts")
    else:
        lines.append(f"  nvshmem: not here: {why}")
    lines.append("low-latency buffer memory (low_latency_memory= or DEEPCOMM_LL_MEMORY):")
    lines.append("  ipc: " + ("available (cudaMalloc + CUDA IPC, peers on this host)" if cuda_reason is None
                              else f"not here: {cuda_reason}"))
    lines.append("  nvshmem: " + (f"available ({lib})" if cuda_reason is None and lib is not None
                                  else f"not here: {cuda_reason or why}"))
    return lines


def env_lines() -> List[str]:
    names = sorted(k for k in os.environ if k.startswith("DEEPCOMM_"))
    if not names:
        return ["environment: no DEEPCOMM_* variable set (docs/environment.md lists them)"]
    return ["environment (docs/environment.md):"] + [f"  {k}={os.environ[k]}" for k in names]


def report() -> str:
    C = load_extension()
    lines = [f"deepcomm {__version__} ({os.path.dirname(os.path.abspath(__file__))})",
             f"python {sys.version.split()[0]}, torch {torch.__version__}"
             + (f" (CUDA {torch.version.cuda})" if torch.version.cuda else " (CPU build)")]
    if C is None:
        lines.append(f"extension deepcomm._C: not available ({extension_error()})")
    else:
        info = build_info(C)
        lines.append(f"extension deepcomm._C: {C.__file__}")
        lines.append(f"  built for: {info.get('cuda_arch') or 'unknown arch'}"
                     + (f", {info['nvcc']}" if info.get("nvcc") else ""))
        compiled, lib, why = nvshmem_status(C)
        lines.append("  NVSHMEM: " + ("compiled in; " if compiled else "not compiled in; ")
                     + (f"host library found: {lib}" if lib else f"host library: {why}" if compiled else why))
        lines.append("  " + exchange_table_line(C))
    lines += gpu_lines()
    topo = nvidia_smi_topology()
    if topo:
        lines += ["links (nvidia-smi topo -m):"] + ["  " + t for t in topo.splitlines()]
    lines += backend_lines(C)
    lines += env_lines()
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print("usage: python -m deepcomm\n\nPrints deepcomm's version, its build, the GPUs and their links, and "
              "what each backend and transport would do on this machine (and why not).")
        return 0
    if args:
        print(f"python -m deepcomm: takes no arguments, got {' '.join(args)}", file=sys.stderr)
        return 2
    print(report())
    return 0
