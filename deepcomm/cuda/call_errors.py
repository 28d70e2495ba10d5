"""What a CUDA backend's calls do with its device error record (deepcomm/cuda/error_record.py): a timeout raises
at once; an input error that a kernel found (bad expert ids, a disagreement between ranks) is kept and raised once
the current call's kernels are launched, so that every rank has joined that call first. One object per error
record, shared by the parts that use the record (a backend's normal mode and its low-latency engine)."""
from __future__ import annotations

from typing import Optional


class CallErrors:
    def __init__(self, record):
        self.record = record
        self.pending: Optional[ValueError] = None  # an input error kept for raise_pending()

    def check(self, low_latency: bool = False) -> None:
        """Timeouts raise now; an input error an earlier call left on the device is kept for raise_pending (one at a
        time: while one is held, the next stays recorded for a later look)."""
        held = self.pending is not None
        err = self.record.check_error(low_latency=low_latency, defer_input=True, leave_input=held)
        if err is not None:
            self.pending = err

    def raise_pending(self) -> None:
        """After a call's kernels are launched (so every rank joined it): raise the kept input error, if any."""
        err, self.pending = self.pending, None
        if err is not None:
            raise err

    def raise_difference(self, err: ValueError) -> None:
        """Raise ``err``, the difference a host-waited exchange of this call found; or, with an input error kept from
        an earlier call, that error first (the other ranks raise it in this call), keeping ``err`` for the next
        look."""
        earlier = self.take_pending()
        if earlier is not None:
            self.pending = err
            raise earlier
        raise err

    def take_pending(self) -> Optional[ValueError]:
        """The kept input error, given up to the caller (which names it in an error of its own)."""
        err, self.pending = self.pending, None
        return err
