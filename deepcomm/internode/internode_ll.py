"""Low-latency mode on topologies of several nodes: the same kernels and buffer as on one node
(deepcomm/cuda/ll_calls.py, deepcomm/cuda/ll_buffer.py), over every rank of the job. A peer NVLink can map
(``nvshmem_ptr``, or CUDA IPC on one host) is written directly; any other is a put peer, reached by NVSHMEM puts from
our outbox (deepcomm/cuda/ll_buffer.py), which on a cluster travel over RDMA. Normal mode's hierarchical path (backend.py) is not involved: decoding sends each token
once per rank that holds one of its experts, with no forwarding inside the node.

The low-latency buffer lives in NVSHMEM memory when the ranks span several hosts (CUDA IPC cannot map across
hosts), else where ``low_latency_memory`` says. Its own error record carries the kernels' timeouts and input
errors (deepcomm/cuda/error_record.py); normal mode's transport and NVLink hop keep theirs."""
from __future__ import annotations

from typing import List

import torch

from ..cuda.error_record import DeviceErrorRecord
from ..cuda.call_errors import CallErrors
from ..cuda.ll_calls import LowLatencyEngine, low_latency_blocks


def low_latency_memory_for(hosts: List[str], configured: str) -> str:
    """NVSHMEM memory when ``hosts`` (one per rank) name more than one host, else ``configured``."""
    return "nvshmem" if len(set(hosts)) > 1 else configured


class InternodeLowLatency:
    """The internode backend's low-latency part: an error record of its own (``record``, its state in ``errors``)
    and the LowLatencyEngine over the whole group (``engine``); ``ll_memory``: "ipc" or "nvshmem"
    (low_latency_memory_for). Nothing collective here: the buffer comes at the first low-latency call."""

    def __init__(self, C, group, config, rank: int, world_size: int, device: torch.device, ll_memory: str):
        self.record = DeviceErrorRecord(C, device, config.timeout_s)
        self.errors = CallErrors(self.record)
        self.engine = LowLatencyEngine(C, group, rank, world_size, device, self.record, self.errors, ll_memory,
                                       low_latency_blocks(C, device))
        self.closed = False

    def synchronize(self) -> None:
        self.errors.check(low_latency=True)
        self.errors.raise_pending()

    def close(self) -> None:
        """Local, like CudaBackend.destroy: the buffer (once idle), then the record."""
        if self.closed:
            return
        self.closed = True
        try:
            self.engine.close()
        finally:
            self.record.free_record()
