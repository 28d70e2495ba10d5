"""What a new Buffer reports through deepcomm's logger (log.py): its backend, transport, topology and sizes."""
from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.distributed as dist

from .backends import BackendChoice
from .config import Config
from .log import logger
from .topology import Topology


class ReportedBuffer(Protocol):
    """The parts of a Buffer its report reads (a Protocol, so that this module needs no import of buffer.py)."""

    buffer_id: int
    rank: int
    world_size: int
    device: torch.device
    group: object
    config: Config
    topology: Topology

    def size_bytes(self) -> int: ...


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def transport_of(buf: ReportedBuffer, choice: BackendChoice) -> str:
    """How the chosen backend moves bytes, in words."""
    cfg = buf.config
    if choice.name == "reference":
        return f"torch.distributed collectives ({dist.get_backend(buf.group)})"
    ll = "NVSHMEM symmetric heap" if cfg.low_latency_memory == "nvshmem" else "CUDA IPC"
    if choice.internode:
        between = {"nvshmem": "NVSHMEM device puts and signals issued by the internode kernels",
                   "nvshmem-host": "NVSHMEM puts and signals from the host API (torch routing)"}.get(
                       cfg.internode_transport, "GPU-posted mlx5 WQEs executed by the device emulated NIC")
        return f"between nodes: {between}; inside a node: NVLink (CUDA IPC); low-latency buffer: {ll}"
    return f"NVLink peer memory (CUDA IPC); low-latency buffer: {ll}"


def describe_buffer(buf: ReportedBuffer, choice: BackendChoice) -> str:
    """One paragraph: backend, transport, topology, num_sms, buffer sizes, and why a faster choice was refused."""
    cfg, topo = buf.config, buf.topology
    lines = [
        f"Buffer {buf.buffer_id}: backend {choice.name!r} ({choice.kind}), requested {choice.requested!r}, "
        f"{buf.world_size} ranks, device {buf.device}",
        f"  transport: {transport_of(buf, choice)}",
        f"  topology: {topo.num_nodes} node(s) x {topo.gpus_per_node} GPU(s)",
        f"  num_sms: {cfg.num_sms}; timeout_s: {cfg.timeout_s:g}",
        f"  sizes: max_tokens_per_rank {cfg.max_tokens_per_rank}, hidden {cfg.hidden}, "
        f"num_max_low_latency_tokens {cfg.num_max_low_latency_tokens}; communication buffers "
        f"{_mib(buf.size_bytes())} on this rank (the low-latency buffer is added at the first low-latency call)",
    ]
    if choice.refused is not None:
        lines.append(f"  not the CUDA kernels: {choice.refused}")
    return "\n".join(lines)


def log_buffer_created(buf: ReportedBuffer, choice: BackendChoice) -> None:
    """Rank 0 logs the Buffer's description at INFO; at DEBUG every rank logs its own line too."""
    if buf.rank == 0 and logger.isEnabledFor(logging.INFO):
        logger.info(describe_buffer(buf, choice))
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(f"rank {buf.rank}: backend {choice.name}, device {buf.device}, "
                     f"{_mib(buf.size_bytes())} of communication buffers")
