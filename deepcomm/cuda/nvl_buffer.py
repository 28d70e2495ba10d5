"""A rank's NVLink buffer: allocation, IPC handle exchange, peer mapping, error record, teardown."""
from __future__ import annotations

import socket
from typing import List, Optional

import torch
import torch.distributed as dist

from ..errors import CommTimeoutError
from .peer_memory import PeerMemory

# Numbers written by the kernels (csrc/runtime/error_record.cuh, enum WaitStage) -> stage names.
STAGES = {
    1: "notify:counts",
    2: "dispatch:mailbox",
    3: "dispatch:done",
    4: "combine:ready",
    5: "combine:token",
    6: "barrier",
    7: "low_latency_dispatch:counts",  # retired (kept so the numbers stay stable)
    8: "low_latency_dispatch:data",
    9: "low_latency_combine:data",
    10: "low_latency_combine:weights",
    20: "qp:room (send queue full, no completions)",
    21: "qp:turn (an earlier post never rang the doorbell)",
    22: "qp:quiet (posted WQEs not completed)",
    23: "nic:doorbell (device NIC waiting for WQEs)",
    24: "qp:error_cqe (a WQE completed with an error)",
    25: "qp:signal (waiting for a peer's fetch-add signal)",
    26: "internode:credit (a peer has not freed its receive slot for us)",
    27: "nvshmem:credit (a peer has not freed its receive slot for us)",
    28: "nvshmem:signal (a peer's block for us has not landed)",
    29: "node:barrier (a GPU of our node has not reached the NVLink hop's barrier)",
    30: "hier:free (a GPU of our node has not freed its area for this call's rows)",
    31: "hier:arrive (a GPU of our node has not finished putting its rows into our area)",
    32: "hier:local (this call's own blocks did not finish packing or reducing)",
}
# Input problems found on the device (not timeouts): every rank stopped the call consistently.
INPUT_ERRORS = {
    100: "topk_idx: expert ids outside [-1, num_experts) on rank {peer_or_some}; nothing was dispatched",
    101: "num_worst_tokens: rank {peer} receives more rows than num_worst_tokens; rows past it were dropped",
    # low-latency dispatch checks on the device and raises at the next call, hook or synchronize()
    102: "topk_idx: an earlier low_latency_dispatch on rank {peer} had expert ids outside [-1, num_experts); "
         "those slots were dropped (sent nowhere)",
    103: "topk_idx: an earlier low_latency_dispatch on rank {peer} had a token naming the same expert twice",
}


class NvlBuffer:
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
            self.err_host, self.err_dev = C.host_mapped_alloc(C.error_record_bytes())
        except BaseException:
            self.memory.close()
            raise
        self.ctx.set_error_record(self.err_dev)
        self.timeout_ns = int(timeout_s * 1e9)
        self.ctx.set_timeout_ns(self.timeout_ns)
        self.broken = False
        self.broken_peer = None
        self.masked: frozenset = frozenset()  # ranks low-latency mode leaves out (Buffer.mask_ranks)
        self.closed = False

    @property
    def arena_ptr(self) -> int:
        return self.ptr + self.layout["arena"]

    @property
    def size_bytes(self) -> int:
        return self.layout["total"]

    def check_error(self, low_latency: bool = False, defer_input: bool = False,
                    leave_input: bool = False) -> Optional[ValueError]:
        """Raise CommTimeoutError if a kernel recorded a timed-out wait; the buffer is then unusable (until the
        peer it waited for is masked, for low-latency mode). Normal mode needs every rank: it refuses to run while
        ranks are masked. A recorded input error (found on the device) is cleared and raised as ValueError, or,
        with ``defer_input``, returned: a call then joins its collective first and raises after it, because
        ranks see such a record at different times and one that skipped the call would leave the others waiting
        and the call numbers out of step. ``leave_input``: an input error stays recorded, for a later look (the
        caller already holds one). A record still being written (flag 2) is left for the next look."""
        if self.broken:
            raise RuntimeError("deepcomm: this Buffer had a communication timeout; destroy it and build a new one on "
                               "every rank, or mask the lost peer (Buffer.mask_ranks) to go on in low-latency mode")
        if self.masked and not low_latency:
            raise RuntimeError(f"deepcomm: ranks {sorted(self.masked)} are masked; normal mode needs every rank "
                               "(unmask them on every rank, or build a new Buffer)")
        flag, rank, peer, stage, seq, waited_ns = self.C.read_error(self.err_host)
        if flag != 1:
            return None
        if stage in INPUT_ERRORS:
            if leave_input:
                return None
            self.C.clear_error(self.err_host)  # the Buffer stays usable
            err = ValueError(INPUT_ERRORS[stage].format(peer=peer, peer_or_some="some rank" if peer < 0 else peer))
            if defer_input:
                return err
            raise err
        if flag:
            self.broken, self.broken_peer = True, peer
            raise CommTimeoutError(rank, peer, STAGES.get(stage, f"stage {stage}"),
                                   f"call #{seq}, waited {waited_ns / 1e9:.3f} s")

    def set_masked(self, ranks: frozenset) -> None:
        """After a timeout waiting for a peer that is now masked, the record is cleared and work may go on."""
        torch.cuda.synchronize(self.device)  # queued kernels gave up at once after the record was set
        flag, _, peer, stage, _, _ = self.C.read_error(self.err_host)
        if flag and stage not in INPUT_ERRORS and not self.broken:
            self.broken, self.broken_peer = True, peer
        if self.broken and self.broken_peer in ranks:
            self.C.clear_error(self.err_host)
            self.broken, self.broken_peer = False, None
        self.masked = ranks

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
            self.C.host_mapped_free(self.err_host)
