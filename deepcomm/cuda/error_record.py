"""A rank's error record: a small mapped-host block the kernels write when a device wait times out or they find bad
input, read by the host after each call (csrc/runtime/error_record.cuh); plus the state that follows from it: a
Buffer broken by a timeout, and the ranks low-latency mode leaves out. The NVLink buffer
(deepcomm/nvlink/nvl_buffer.py) owns one; so does the low-latency mode of the internode backend
(deepcomm/internode/internode_ll.py)."""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

from ..errors import CommTimeoutError, crossing_failure_text
from .agree_record import recorded_disagreement
from .wait_stages import input_error_text, stage_text

class DeviceErrorRecord:
    """The record (``err_dev`` for the kernels, ``err_host`` for us), the kernels' wait timeout in ns, and what a
    look at the record decides."""
    # the record's first word (its flag) read in place: a look at an empty record, at every call, then costs no
    # crossing into the extension (None: always ask the extension)
    _flag_word: Optional[ctypes.c_int] = None
    broken_reason: Optional[str] = None  # why the Buffer is broken, where not by a timeout (set_broken_by)

    def __init__(self, C, device: torch.device, timeout_s: float):
        self.C, self.device = C, device
        self.err_host, self.err_dev = C.host_mapped_alloc(C.error_record_bytes())
        self._flag_word = ctypes.c_int.from_address(self.err_host)  # ErrorRecord::flag, offset 0
        # where the kernels leave every rank's words when a call's fingerprints differ (agree_record.py)
        try:
            self.agree_host, self.agree_dev = C.host_mapped_alloc(C.agree_record_bytes())
        except BaseException:
            C.host_mapped_free(self.err_host)
            raise
        C.clear_agree(self.agree_host)
        self.timeout_ns = int(timeout_s * 1e9)
        self.broken = False
        self.broken_peer = None
        self.masked: frozenset = frozenset()  # ranks low-latency mode leaves out (Buffer.mask_ranks)
        # words of calls of the other mode that peers made while this rank's call met them (mode_meet.py)
        self.owed: list = []

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
            if self.broken_reason is not None:
                raise RuntimeError(self.broken_reason)
            raise RuntimeError("deepcomm: this Buffer had a communication timeout; destroy it and build a new one on "
                               "every rank, or mask the lost peer (Buffer.mask_ranks) to go on in low-latency mode")
        word = self._flag_word
        if word is not None and word.value == 0 and (not self.masked or low_latency):
            return None  # nothing recorded (a kernel claims the flag before it writes the rest)
        if self.masked and not low_latency:
            raise RuntimeError(f"deepcomm: ranks {sorted(self.masked)} are masked; normal mode needs every rank "
                               "(unmask them on every rank, or build a new Buffer)")
        flag, rank, peer, stage, seq, waited_ns = self.C.read_error(self.err_host)
        if flag != 1:
            return None
        input_error = input_error_text(self.C, stage)
        if input_error is not None:
            if leave_input:
                return None
            if stage == self.C.WAIT_STAGES.get("disagree"):  # the fingerprints differed: every rank's words are kept
                err = recorded_disagreement(self.C, self.agree_host, getattr(self, "rank", None), self.masked,
                                            self.owed)
            else:
                err = ValueError(input_error.format(peer=peer, peer_or_some="some rank" if peer < 0 else peer,
                                                    count=waited_ns))
            self.C.clear_error(self.err_host)  # the Buffer stays usable
            if defer_input:
                return err
            raise err
        if flag:
            self.broken, self.broken_peer = True, peer
            raise CommTimeoutError(rank, peer, stage_text(self.C, stage),
                                   f"call #{seq}, waited {waited_ns / 1e9:.3f} s")

    def set_broken_by(self, call: str, error: BaseException) -> None:
        """``call`` raised ``error`` inside its crossing into the extension, where its first exchange may have
        begun: the peers may wait for what this rank never sent, so the Buffer takes no more calls here (its next
        one would meet theirs out of step); each later call raises RuntimeError saying why."""
        if not self.broken:
            self.broken, self.broken_peer, self.broken_reason = True, None, crossing_failure_text(call, error)

    def set_masked(self, ranks: frozenset) -> None:
        """After a timeout waiting for a peer that is now masked, the record is cleared and work may go on."""
        torch.cuda.synchronize(self.device)  # queued kernels gave up at once after the record was set
        flag, _, peer, stage, _, _ = self.C.read_error(self.err_host)
        if flag and input_error_text(self.C, stage) is None and not self.broken:
            self.broken, self.broken_peer = True, peer
        if self.broken and self.broken_peer in ranks:
            self.C.clear_error(self.err_host)
            self.broken, self.broken_peer = False, None
        self.masked = ranks

    def free_record(self) -> None:
        self._flag_word = None
        self.C.host_mapped_free(self.err_host)
        self.C.host_mapped_free(self.agree_host)
