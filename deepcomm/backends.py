"""Which backend a Buffer gets, and why "cuda" is refused when it is.

``backend="auto"`` never falls back to the reference backend without saying so: where the CUDA kernels could have
run (CUDA present, an NCCL group), or whenever the ranks span several hosts, the reason they did not is a
``RuntimeWarning``, once per process and reason. ``backend="cuda"`` raises ``RuntimeError`` with the reason instead.

With ranks on several hosts the CUDA backend is the internode one, and its RDMA hop goes through NVSHMEM: unless
``internode_transport`` (or ``DEEPCOMM_INTERNODE_TRANSPORT``) chooses a transport, "auto" and "cuda" take
"nvshmem" there (the default "emulated" NIC reaches other GPUs over NVLink, so it serves one host only).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from ._ext import extension_error, load_extension
from .config import NVSHMEM_TRANSPORTS, Config
from .hosts import hosts_of
from .log import configure_from_env

BACKENDS = ("auto", "cuda", "reference")


def group_uses_nccl(group) -> bool:
    return "nccl" in str(dist.get_backend(group)).lower()


def group_device(group, backend: str = "auto") -> torch.device:
    """Where a Buffer's tensors live (docs/api.md, "Process groups and devices"): the current CUDA device for an
    NCCL group; for another group (gloo) the current CUDA device when ``backend`` is "cuda" (the CUDA backend uses
    the group only to set up: handle exchange, barriers, the store; ranks sharing one GPU need this, since NCCL
    refuses them), else the CPU ("auto" and "reference" keep a gloo group's Buffer on the CPU)."""
    if group_uses_nccl(group) or (backend == "cuda" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cuda_unavailable_reason(group=None, requested: str = "cuda") -> Optional[str]:
    """``None`` when the CUDA backend can run (for ``group``, when given, and the ``requested`` backend name);
    otherwise the reason. A group other than NCCL serves the CUDA backend only when it is asked for by name."""
    if load_extension() is None:
        return f"the extension deepcomm._C is not available ({extension_error()})"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if group is not None and requested != "cuda" and not group_uses_nccl(group):
        return (f"the process group uses {dist.get_backend(group)!r}: backend='auto' picks the CUDA backend only for "
                "NCCL groups (backend='cuda' runs it over this group, on the current CUDA device)")
    try:
        from .nvlink.backend import CudaBackend  # noqa: F401
    except ImportError as exc:
        return f"deepcomm.nvlink.backend cannot be imported ({exc})"
    return None


def available_backends() -> List[str]:
    """Backends usable in this process (ignoring the process group): always "reference", "cuda" when built."""
    return ["reference"] + (["cuda"] if cuda_unavailable_reason() is None else [])


@dataclass(frozen=True)
class BackendChoice:
    """What ``make_backend`` picked: ``name`` "cuda" or "reference" (as ``Buffer.backend_name``); ``internode``: the
    topology has several nodes; ``refused``: why the CUDA backend was not taken (None when it was, or when the
    reference backend was asked for); ``faster_possible``: CUDA and an NCCL group were there, so the reference
    backend is a fallback a user should hear about."""

    requested: str
    name: str
    internode: bool
    refused: Optional[str] = None
    faster_possible: bool = False
    transport: Optional[str] = None  # the internode transport the CUDA backend takes ("emulated" | "nvshmem")

    @property
    def kind(self) -> str:
        if self.name == "reference":
            return "pure PyTorch"
        return "CUDA kernels, hierarchical: RDMA between nodes, NVLink inside" if self.internode \
            else "CUDA kernels, NVLink"


_warned: Set[str] = set()


def group_hosts(group, world_size: int) -> Optional[List[str]]:
    """Every rank's host name (``hosts_of``), or None without an initialized process group (only this process).
    Collective over ``group``."""
    if world_size < 2 or not (dist.is_available() and dist.is_initialized()):
        return None
    return hosts_of(group)


def nvshmem_unavailable_reason(transport: str = "nvshmem-host") -> Optional[str]:
    """``None`` when NVSHMEM's host library opens (deepcomm/cuda/nvshmem_library.py) and, for the "nvshmem"
    transport (device puts), the optional module deepcomm._nvshmem_kernels loads; otherwise why not."""
    try:
        from .cuda.nvshmem_library import NvshmemUnavailableError, load_library
        from .internode.nvshmem_kernels import unavailable_reason
    except ImportError as exc:
        return f"NVSHMEM support cannot be imported ({exc})"
    try:
        load_library()
    except NvshmemUnavailableError as exc:
        return f"NVSHMEM is not available ({str(exc).splitlines()[0]})"
    if transport == "nvshmem":
        return unavailable_reason()
    return None


def choose_backend(requested: str, group, config: Config, world_size: int) -> BackendChoice:
    """Decide the backend for ``requested`` ("auto" | "cuda" | "reference"). Collective over ``group`` (it compares
    host names) unless "reference" is requested. ``backend="cuda"`` that cannot run raises ``RuntimeError`` naming
    the reason."""
    if requested not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {requested!r}")
    internode = config.gpus_per_node is not None and config.gpus_per_node < world_size
    if requested == "reference":
        return BackendChoice(requested, "reference", internode)
    hosts = group_hosts(group, world_size)  # on every rank, whatever it decides next: a collective
    several_hosts = hosts is not None and len(set(hosts)) > 1
    transport = config.internode_transport
    if internode and several_hosts and not config.internode_transport_chosen:
        transport = "nvshmem"  # the only transport that reaches other hosts
    reason = cuda_unavailable_reason(group, requested)
    if reason is None and several_hosts and not internode:
        reason = ("the ranks span several hosts but the topology is one node; set LOCAL_WORLD_SIZE (torchrun and "
                  "deepcomm's launchers do), DEEPCOMM_GPUS_PER_NODE or Buffer(gpus_per_node=...)")
    if reason is None and internode:
        reason = internode_unavailable_reason(group, world_size, transport, config.gpus_per_node, hosts)
        if reason is None and transport in NVSHMEM_TRANSPORTS:
            reason = nvshmem_unavailable_reason(transport)
        if reason is not None:
            reason = f"the internode CUDA backend cannot run: {reason}"
    if reason is not None and requested == "cuda":
        raise RuntimeError(f"deepcomm: backend='cuda' cannot run here: {reason}")
    faster_possible = reason is not None and (several_hosts or (torch.cuda.is_available() and group_uses_nccl(group)))
    return BackendChoice(requested, "cuda" if reason is None else "reference", internode, reason, faster_possible,
                         transport if internode and reason is None else None)


def warn_if_fallback(choice: BackendChoice, rank: int) -> None:
    """Rank 0 warns, once per process and reason, that ``backend="auto"`` took the reference backend where the
    CUDA kernels could have run."""
    if rank != 0 or not choice.faster_possible or choice.refused in _warned:
        return
    _warned.add(choice.refused)
    warnings.warn(f"deepcomm: backend='auto' uses the reference backend (torch collectives, much slower than the "
                  f"CUDA kernels) because {choice.refused}; pass backend='reference' to choose it explicitly",
                  RuntimeWarning, stacklevel=4)


def make_backend(requested: str, group, config: Config, rank: int, world_size: int,
                 device: torch.device, buffer_number: Optional[int] = None) -> Tuple[object, BackendChoice]:
    """Build the backend object for ``requested`` ("auto" | "cuda" | "reference"); returns ``(backend, choice)``.
    ``buffer_number``: the Buffer's number in its group, the same on every rank (rendezvous.wait_for_group)."""
    configure_from_env()
    choice = choose_backend(requested, group, config, world_size)
    warn_if_fallback(choice, rank)
    if choice.name == "cuda" and choice.internode:
        from .internode.backend import InternodeBackend
        config.internode_transport = choice.transport  # the Buffer's config says what carries the RDMA hop
        return InternodeBackend(group, config, rank, world_size, device, load_extension()), choice
    if choice.name == "cuda":
        from .nvlink.backend import CudaBackend
        return CudaBackend(group, config, rank, world_size, device), choice
    from .reference import ReferenceBackend
    return ReferenceBackend(group, config, rank, world_size, device, buffer_number), choice


def internode_unavailable_reason(group, world_size: int, transport: str = "emulated", gpus_per_node: int = 1,
                                 hosts: Optional[List[str]] = None) -> Optional[str]:
    """``None`` when the internode CUDA backend can run. Collective over ``group`` unless ``hosts`` (every rank's
    host name) is given.
    The topology must fit the extension's internode tables (at most ``INTERNODE_MAX_RANKS`` ranks and
    ``INTERNODE_MAX_NODES`` nodes, csrc/runtime/internode_limits.hpp). The "emulated" transport's WQEs are executed
    by the device emulated NIC, which reaches the "remote" GPU over NVLink, so every rank must be on one host. The
    "nvshmem" transport leaves the reaching to NVSHMEM, so ranks may span hosts (docs/internode.md), but the NVLink
    hop inside a node maps its peers' memory with CUDA IPC, so the ranks of one node (``gpus_per_node``
    consecutive ranks) share a host."""
    from .internode.internode_size import internode_size_problem
    C = load_extension()
    if C is None:
        return f"the extension deepcomm._C is not available ({extension_error()})"
    problem = internode_size_problem(C.transport, world_size, gpus_per_node)
    if problem is not None:
        return problem
    if hosts is None:
        hosts = hosts_of(group)
    for node in range(world_size // gpus_per_node):
        on = sorted(set(hosts[node * gpus_per_node:(node + 1) * gpus_per_node]))
        if len(on) > 1:
            return (f"the ranks of node {node} (gpus_per_node={gpus_per_node}) are on several hosts ({', '.join(on)}); "
                    "the NVLink hop inside a node needs them on one host")
    if len(set(hosts)) > 1 and transport not in NVSHMEM_TRANSPORTS:
        return ("the ranks span several hosts; the internode CUDA backend's emulated NIC runs only on one host posing "
                "as several nodes (internode_transport='nvshmem', or DEEPCOMM_INTERNODE_TRANSPORT=nvshmem, reaches "
                "other hosts through NVSHMEM)")
    return None
