"""A rank's error record: a small mapped-host block the kernels write when a device wait times out or they find bad
input, read by the host after each call (csrc/runtime/error_record.cuh); plus the state that follows from it: a
Buffer broken by a timeout, and the ranks low-latency mode leaves out. The NVLink buffer (nvl_buffer.py) owns one;
so does the low-latency mode of the internode backend (internode_ll.py)."""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import CommTimeoutError

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


class DeviceErrorRecord:
    """The record (``err_dev`` for the kernels, ``err_host`` for us), the kernels' wait timeout in ns, and what a
    look at the record decides."""

    def __init__(self, C, device: torch.device, timeout_s: float):
        self.C, self.device = C, device
        self.err_host, self.err_dev = C.host_mapped_alloc(C.error_record_bytes())
        self.timeout_ns = int(timeout_s * 1e9)
        self.broken = False
        self.broken_peer = None
        self.masked: frozenset = frozenset()  # ranks low-latency mode leaves out (Buffer.mask_ranks)

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

    def free_record(self) -> None:
        self.C.host_mapped_free(self.err_host)
