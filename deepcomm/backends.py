"""Which backend a Buffer gets, and why "cuda" is refused when it is."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ._ext import extension_error, load_extension
from .config import Config

BACKENDS = ("auto", "cuda", "reference")


def group_uses_nccl(group) -> bool:
    return "nccl" in str(dist.get_backend(group)).lower()


def group_device(group) -> torch.device:
    """Where the group's tensors live: the current CUDA device for NCCL groups, else the CPU."""
    if group_uses_nccl(group):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cuda_unavailable_reason(group=None) -> Optional[str]:
    """``None`` when the CUDA backend can run (for ``group``, when given); otherwise the reason."""
    if load_extension() is None:
        return f"the extension deepcomm._C is not available ({extension_error()})"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if group is not None and not group_uses_nccl(group):
        return f"the process group uses {dist.get_backend(group)!r}, the CUDA backend needs NCCL"
    try:
        from .cuda.backend import CudaBackend  # noqa: F401
    except ImportError as exc:
        return f"deepcomm.cuda.backend cannot be imported ({exc})"
    return None


def available_backends() -> List[str]:
    """Backends usable in this process (ignoring the process group): always "reference", "cuda" when built."""
    return ["reference"] + (["cuda"] if cuda_unavailable_reason() is None else [])


def make_backend(requested: str, group, config: Config, rank: int, world_size: int,
                 device: torch.device, buffer_number: Optional[int] = None) -> Tuple[object, str]:
    """Build the backend object for ``requested`` ("auto" | "cuda" | "reference"); returns ``(backend, name)``.
    ``buffer_number``: the Buffer's number in its group, the same on every rank (rendezvous.wait_for_group)."""
    if requested not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {requested!r}")
    name = requested
    internode = config.gpus_per_node is not None and config.gpus_per_node < world_size
    if requested != "reference":
        reason = cuda_unavailable_reason(group)
        if reason is None and internode:
            reason = internode_unavailable_reason(group, world_size, config.internode_transport,
                                                  config.gpus_per_node)
        if reason is not None and requested == "cuda":
            raise RuntimeError(f"deepcomm: backend='cuda' cannot run here: {reason}")
        name = "cuda" if reason is None else "reference"
    if name == "cuda" and internode:
        from .cuda.internode import InternodeBackend
        return InternodeBackend(group, config, rank, world_size, device, load_extension()), name
    if name == "cuda":
        from .cuda.backend import CudaBackend
        return CudaBackend(group, config, rank, world_size, device), name
    from .reference import ReferenceBackend
    return ReferenceBackend(group, config, rank, world_size, device, buffer_number), name


def internode_unavailable_reason(group, world_size: int, transport: str = "emulated",
                                 gpus_per_node: int = 1) -> Optional[str]:
    """``None`` when the internode CUDA backend can run. Collective over ``group`` (it compares host names).
    The "emulated" transport's WQEs are executed by the device emulated NIC, which reaches the "remote" GPU over
    NVLink, so every rank must be on one host. The "nvshmem" transport leaves the reaching to NVSHMEM, so ranks
    may span hosts (not tested across hosts yet: docs/internode.md), but the NVLink hop inside a node maps its
    peers' memory with CUDA IPC, so the ranks of one node (``gpus_per_node`` consecutive ranks) share a host."""
    from .cuda.internode import MAX_RANKS, hosts_of
    if world_size > MAX_RANKS:
        return f"the internode transport takes at most {MAX_RANKS} ranks, the group has {world_size}"
    hosts = hosts_of(group)
    for node in range(world_size // gpus_per_node):
        on = sorted(set(hosts[node * gpus_per_node:(node + 1) * gpus_per_node]))
        if len(on) > 1:
            return (f"the ranks of node {node} (gpus_per_node={gpus_per_node}) are on several hosts ({', '.join(on)}); "
                    "the NVLink hop inside a node needs them on one host")
    if len(set(hosts)) > 1 and transport == "emulated":
        return ("the ranks span several hosts; the internode CUDA backend's emulated NIC runs only on one host posing "
                "as several nodes (internode_transport='nvshmem', or DEEPCOMM_INTERNODE_TRANSPORT=nvshmem, reaches "
                "other hosts through NVSHMEM)")
    return None
