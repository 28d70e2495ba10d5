"""A rank's NVLink buffer: allocation, IPC handle exchange, peer mapping, teardown; and its error record
(deepcomm/cuda/error_record.py)."""
from __future__ import annotations

import socket
from typing import List

import torch
import torch.distributed as dist

from ..cuda.error_record import DeviceErrorRecord
from ..cuda.peer_memory import PeerMemory


class NvlBuffer(DeviceErrorRecord):
    """Owns the device allocation, the peer mappings and the mapped-host error record of one rank."""

    def __init__(self, C, group, rank: int, world_size: int, device: torch.device, local_experts_cap: int,
                 max_tokens: int, hidden_max: int, topk_max: int, arena_bytes: int, timeout_s: float):
        if world_size > C.MAX_RANKS:
            raise RuntimeError(f"the NVLink backend serves at most {C.MAX_RANKS} ranks, got {world_size}")
        hosts: List[str] = [None] * world_size  # type: ignore[list-item]
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        if len(set(hosts)) != 1:
            raise RuntimeError("the NVLink backend needs every rank on one host; got hosts " + ", ".join(sorted(set(hosts))))
        self.C, self.group, self.rank, self.world_size, self.device = C, group, rank, world_size, device
        self.ctx = C.NvlContext(rank, world_size, local_experts_cap, max_tokens, hidden_max, topk_max, arena_bytes)
        self.layout = self.ctx.layout()
        self.memory = PeerMemory(C, group, rank, world_size, self.layout["total"])
        self.ptr = self.memory.ptr
        for r, p in enumerate(self.memory.peer_ptrs):
            self.ctx.set_peer(r, p)
        try:
            DeviceErrorRecord.__init__(self, C, device, timeout_s)
        except BaseException:
            self.memory.close()
            raise
        self.ctx.set_error_record(self.err_dev)
        self.ctx.set_error_host(self.err_host)
        self.ctx.set_agree_record(self.agree_dev)
        # a fresh dispatch's counts for the host (csrc/runtime/dispatch_counts.hpp), written by the notify kernel
        self.counts_host, counts_dev = C.host_mapped_alloc(C.DISPATCH_COUNTS_BYTES)
        self.ctx.set_dispatch_counts(self.counts_host, counts_dev)
        self.ctx.set_timeout_ns(self.timeout_ns)
        self.closed = False

    @property
    def arena_ptr(self) -> int:
        return self.ptr + self.layout["arena"]

    @property
    def size_bytes(self) -> int:
        return self.layout["total"]

    def close(self) -> None:
        """Unmap the peers and free our memory. No collective: it is safe from __del__ on one rank alone, because
        every kernel waits for all peer writes addressed to it before it ends, so once our stream is idle no peer
        is still writing into us."""
        if self.closed:
            return
        self.closed = True
        try:
            torch.cuda.synchronize(self.device)
            self.memory.close()
        finally:
            self.C.host_mapped_free(self.counts_host)
            self.free_record()
