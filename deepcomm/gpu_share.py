"""Several ranks on one GPU: the SMs a rank's kernels may take, and which ranks share a GPU.

Kernels whose blocks wait for other blocks (the normal combine's reducers for its senders, every kernel for its
peers' blocks) need all those blocks resident at once. One rank per GPU, that means at most the GPU's SMs; ranks
sharing a GPU (processes under MPS) split its SMs, so each must stay within its share or their waiting blocks can
fill the GPU while the blocks they wait for never start. ``DEEPCOMM_GPU_SMS`` is that share: the SMs a rank
assumes its GPU has (the default normal-mode ``num_sms``, low-latency blocks and the emulated NIC's blocks are
sized from it, and ``num_sms`` above it is refused). deepcomm.local_launch and the GPU test runner set it to the
GPU's SMs divided by the ranks on it when they start several ranks per GPU.
"""
from __future__ import annotations

import os
import socket
from typing import List, Sequence

import torch
import torch.distributed as dist

from .config import env_positive_int

GPU_SMS_ENV = "DEEPCOMM_GPU_SMS"


def sms_per_rank(sm_count: int, ranks_on_gpu: int) -> int:
    """Each rank's share of a GPU of ``sm_count`` SMs that ``ranks_on_gpu`` ranks use at once (at least 1)."""
    if ranks_on_gpu < 1:
        raise ValueError(f"ranks_on_gpu: expected at least 1, got {ranks_on_gpu}")
    return max(1, sm_count // ranks_on_gpu)


def shares_gpu() -> bool:
    """Whether this rank was given a share of its GPU (``$DEEPCOMM_GPU_SMS`` set): ranks share the GPU."""
    return bool(os.environ.get(GPU_SMS_ENV, "").strip())


def sm_budget(sm_count: int) -> int:
    """``sm_count``, or ``$DEEPCOMM_GPU_SMS`` where that is set and smaller; ValueError names the variable."""
    n = env_positive_int(GPU_SMS_ENV)
    return sm_count if n is None else min(n, sm_count)


def usable_sms(device: torch.device) -> int:
    """SMs this rank's communication kernels may take on ``device``: its SMs within ``$DEEPCOMM_GPU_SMS``."""
    return sm_budget(torch.cuda.get_device_properties(device).multi_processor_count)


def gpu_identity(device: torch.device) -> str:
    """A name of the physical GPU behind ``device``, the same in every process that uses it: host and UUID
    (visible-device numbering differs between processes, the UUID does not)."""
    props = torch.cuda.get_device_properties(device)
    uuid = str(getattr(props, "uuid", "") or "")
    if not uuid:  # older torch: the PCI address names the device as well
        uuid = "pci:" + ":".join(str(getattr(props, f, "?")) for f in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    return f"{socket.gethostname()}/{uuid}"


def most_ranks_on_one_gpu(identities: Sequence[str]) -> int:
    """The largest number of ranks that name one GPU in ``identities`` (one entry per rank); 0 for none."""
    counts = {}
    for name in identities:
        counts[name] = counts.get(name, 0) + 1
    return max(counts.values(), default=0)


def gather_gpu_identities(group, device: torch.device) -> List[str]:
    """Collective over ``group``: every rank's ``gpu_identity``, in rank order."""
    names: List[str] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(names, gpu_identity(device), group=group)
    return names
