"""Low-latency mode on topologies of several nodes: the same kernels and buffer as on one node (ll_calls.py,
ll_buffer.py), over every rank of the job. A peer NVLink can map (``nvshmem_ptr``, or CUDA IPC on one host) is
written directly; any other is a put peer, reached by NVSHMEM puts from our outbox (ll_buffer.py), which on a
cluster travel over RDMA. Normal mode's hierarchical path (internode.py) is not involved: decoding sends each token
once per rank that holds one of its experts, with no forwarding inside the node.

The low-latency buffer lives in NVSHMEM memory when the ranks span several hosts (CUDA IPC cannot map across
hosts), else where ``low_latency_memory`` says. Its own error record carries the kernels' timeouts and input
errors (error_record.py); normal mode's transport and NVLink hop keep theirs."""
from __future__ import annotations

from typing import List, Optional

import torch

from .error_record import DeviceErrorRecord
from .ll_calls import LowLatencyCalls, low_latency_blocks


def low_latency_memory_for(hosts: List[str], configured: str) -> str:
    """NVSHMEM memory when ``hosts`` (one per rank) name more than one host, else ``configured``."""
    return "nvshmem" if len(set(hosts)) > 1 else configured


class InternodeLowLatency(LowLatencyCalls):
    """The internode backend's low-latency calls (LowLatencyCalls over the whole group); ``ll_memory``: "ipc" or
    "nvshmem" (low_latency_memory_for). Nothing collective here: the buffer comes at the first low-latency call."""

    def __init__(self, C, group, config, rank: int, world_size: int, device: torch.device, ll_memory: str):
        self.C, self.group, self.rank, self.world_size, self.device = C, group, rank, world_size, device
        self.ll_memory = ll_memory
        self.ll_blocks = low_latency_blocks(C, device)
        self.nvl = DeviceErrorRecord(C, device, config.timeout_s)
        self._ll = None
        self._pending_input: Optional[ValueError] = None
        self.closed = False

    def synchronize(self) -> None:
        self._check(low_latency=True)
        self._raise_pending()

    def close(self) -> None:
        """Local, like CudaBackend.destroy: the buffer (once idle), then the record."""
        if self.closed:
            return
        self.closed = True
        try:
            self._close_low_latency()
        finally:
            self.nvl.free_record()
