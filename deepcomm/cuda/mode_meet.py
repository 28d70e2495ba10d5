"""A normal-mode call on some ranks meeting a low-latency call on others, on the NVLink backend (CudaBackend).

The two modes keep their call numbers and agree slots in their own buffers (the NVLink buffer, the low-latency
buffer). Each mode's device wait for a peer's words also looks at the other mode's agree slots in this rank's own
memory (csrc/kernels/agree.cuh, WaitCtx::cross), so a peer in a call of the other mode with the same call number is
met there: every rank stops the call and raises the ValueError of the difference ("call order: ... (dispatch #8 on
rank 0 vs low_latency_dispatch #8 on rank 1) ..."), with no extra round trip on any call.

Such a call advanced each rank's call numbers of its own mode only. To keep the Buffer usable, every rank then pays
the call it owes to the other mode (the words the error record kept: agree_record.other_mode_words) before its next
call of that mode: a call that only takes part in the first exchange and moves nothing (the "rejected call" kernels,
agree_reject.cu), so both modes' numbers are in step on every rank again. A rank learns that it owes a call when it
reads its error record; so that it has read it before a call of the other mode, the first call after a switch of
mode waits for this device's work to finish (not while a CUDA graph is captured, where no host wait can be made).

Before a Buffer's first low-latency call there are no low-latency slots to meet in: that call makes the buffer in a
host exchange that a peer in a normal-mode call never joins. So its words first go through the NVLink buffer's agree
slots as a normal-mode call that moves nothing (first_low_latency_call): a peer in a normal-mode call meets them
there, and every rank raises the difference. Every rank in the low-latency call takes one normal-mode call number
there, as the peer's call does; no rank's low-latency numbers move, and the buffer made next starts them afresh, so
the low-latency call the peer's record says it owes is void (link).
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from ..validation import is_capturing
from .agree_record import is_low_latency

NVL_CROSS_SETS = 2  # the NVLink buffer's agree slots: [2 (seq parity)][R] (csrc/runtime/nvl_layout.hpp)
LL_CROSS_SETS = 4   # the low-latency buffer's: [2 kinds][2 slots][R] (csrc/runtime/ll_layout.hpp)


class ModeMeet:
    """Shared by a CudaBackend's normal mode and its LowLatencyEngine. ``nvl``: the NvlBuffer (its context, its
    error record with ``owed``, and its own agree slots)."""

    def __init__(self, nvl, device: torch.device, normal_exchange: Optional[Callable[[tuple], None]] = None):
        self.nvl, self.device = nvl, device
        self.low_latency: Optional[bool] = None  # the mode of the last call (None before any)
        # the backend's normal-mode call of some words that takes part in the first exchange, compares and moves
        # nothing (agree_reject with compare), queued in normal mode's stream order (first_low_latency_call)
        self.normal_exchange = normal_exchange

    def first_low_latency_call(self, fingerprint, errors, rejected: bool = False) -> bool:
        """Before the first low-latency call makes the buffer: ``fingerprint`` (that call's words) through the NVLink
        buffer's agree slots as a normal-mode call, and a wait for it; the difference a peer in another call shows
        there raises here (ValueError, the reference backend's text), as it does on that peer, unless the call is
        one this rank ``rejected`` (the difference names this rank; its caller raises its own error). False where no
        such call can run (no words, masked ranks, graph capture: no host wait): then nothing was exchanged, and the
        host exchange that makes the buffer is the first."""
        if self.normal_exchange is None or fingerprint is None or self.nvl.masked or is_capturing():
            return False
        # what earlier calls left in the record first (a timeout raises; an input error stays pending), so that the
        # record read after the exchange holds the exchange's own difference or nothing
        torch.cuda.synchronize(self.device)
        errors.check(low_latency=True)
        self.normal_exchange(tuple(fingerprint))
        # the whole device: a synchronize of the raw stream the exchange ran on did not always wait for it (seen
        # with the default stream under MPS), and the record was then read before the kernel wrote it
        torch.cuda.synchronize(self.device)
        owed = len(self.nvl.owed)
        err = self.nvl.check_error(low_latency=True, defer_input=True)
        del self.nvl.owed[owed:]  # this rank took its normal-mode number: it owes the peers none
        if err is not None and not rejected:
            errors.raise_difference(err)
        return True

    def link(self, ll) -> None:
        """A low-latency buffer (LlBuffer) was made: each mode's waits look at the other's slots from now on. A
        buffer with peers reached by puts compares its words inside the blocks the host puts, never in its agree
        slots (ll_common.cuh): nothing to link. Its low-latency call numbers start afresh on every rank: a
        low-latency call owed from before is void."""
        self.nvl.owed = [w for w in self.nvl.owed if not is_low_latency(w)]
        if ll.put_peers:
            self.unlink(ll)
            return
        ll.ctx.set_cross_slots(self.nvl.ptr + self.nvl.layout["agree"], NVL_CROSS_SETS)
        self.nvl.ctx.set_cross_slots(ll.memory.ptr + ll.layout["agree"], LL_CROSS_SETS)

    def unlink(self, ll=None) -> None:
        """Before the low-latency buffer is freed (its device is idle then): normal-mode waits stop looking there,
        and calls owed to it are void (a new buffer starts every rank's low-latency numbers afresh)."""
        self.nvl.ctx.set_cross_slots(0, 0)
        if ll is not None:
            ll.ctx.set_cross_slots(0, 0)
        self.nvl.owed = [w for w in self.nvl.owed if not is_low_latency(w)]

    def enter(self, low_latency: bool, errors) -> List[tuple]:
        """Before a call of mode ``low_latency``: after a switch of mode, wait for this device's work and read the
        error record (an input error it holds is kept by ``errors`` for raise_pending, as at every call); then hand
        over, and forget, the calls this rank owes to this mode (their words)."""
        if self.low_latency is not None and self.low_latency != low_latency and not is_capturing():
            torch.cuda.synchronize(self.device)
            errors.check(low_latency=True)
        self.low_latency = low_latency
        owed = self.nvl.owed
        if not owed:
            return []
        mine = [w for w in owed if is_low_latency(w) == low_latency]
        self.nvl.owed = [w for w in owed if is_low_latency(w) != low_latency]
        return mine
