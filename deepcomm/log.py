"""deepcomm's logger ("deepcomm", Python's logging) and what a new Buffer reports through it.

``DEEPCOMM_LOG=info`` (or ``debug``, ``warning``, ``error``) attaches a stderr handler to the "deepcomm" logger at
that level. Without it deepcomm adds no handler: configure the logger as any other (``logging.getLogger("deepcomm")``).
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:  # annotations only: buffer.py imports this module's callers
    from .backends import BackendChoice
    from .buffer import Buffer

LOG_ENV = "DEEPCOMM_LOG"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}

logger = logging.getLogger("deepcomm")
_handler = None  # the handler DEEPCOMM_LOG attached, kept so that a second call does not add another


def configure_from_env() -> None:
    """Apply ``$DEEPCOMM_LOG`` (trimmed, any case; empty: leave the logger alone). ``ValueError`` names the
    variable when its value is not a level."""
    global _handler
    value = os.environ.get(LOG_ENV, "").strip().lower()
    if not value:
        return
    if value not in LEVELS:
        raise ValueError(f"{LOG_ENV}: expected one of {', '.join(LEVELS)}, got {os.environ[LOG_ENV]!r}")
    if _handler is None:
        _handler = logging.StreamHandler()
        _handler.setFormatter(logging.Formatter("[deepcomm %(levelname)s] %(message)s"))
        logger.addHandler(_handler)
    logger.setLevel(LEVELS[value])


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def transport_of(buf: "Buffer", choice: "BackendChoice") -> str:
    """How the chosen backend moves bytes, in words."""
    cfg = buf.config
    if choice.name == "reference":
        return f"torch.distributed collectives ({dist.get_backend(buf.group)})"
    ll = "NVSHMEM symmetric heap" if cfg.low_latency_memory == "nvshmem" else "CUDA IPC"
    if choice.internode:
        between = ("NVSHMEM puts and signals" if cfg.internode_transport == "nvshmem"
                   else "GPU-posted mlx5 WQEs executed by the device emulated NIC")
        return f"between nodes: {between}; inside a node: NVLink (CUDA IPC); low-latency buffer: {ll}"
    return f"NVLink peer memory (CUDA IPC); low-latency buffer: {ll}"


def describe_buffer(buf: "Buffer", choice: "BackendChoice") -> str:
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


def log_buffer_created(buf: "Buffer", choice: "BackendChoice") -> None:
    """Rank 0 logs the Buffer's description at INFO; at DEBUG every rank logs its own line too."""
    if buf.rank == 0 and logger.isEnabledFor(logging.INFO):
        logger.info(describe_buffer(buf, choice))
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(f"rank {buf.rank}: backend {choice.name}, device {buf.device}, "
                     f"{_mib(buf.size_bytes())} of communication buffers")
