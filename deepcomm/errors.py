"""Exceptions raised by deepcomm."""
from __future__ import annotations

from typing import Optional


def crossing_failure_text(call: str, error: BaseException) -> str:
    """Why a Buffer takes no more calls after ``call`` raised ``error`` inside its crossing into the extension,
    where its exchange with the other ranks may have begun (they may wait for what this rank never sent)."""
    return (f"deepcomm: this Buffer's {call} failed inside its crossing into the extension, after its exchange with "
            f"the other ranks may have begun ({type(error).__name__}: {error}); the other ranks' call cannot finish "
            "(they end in a CommTimeoutError): destroy this Buffer and build a new one on every rank")


class CommTimeoutError(RuntimeError):
    """A wait for a peer passed ``timeout_s``.

    ``rank`` is the rank that gave up waiting, ``peer`` the rank it was waiting for (``None`` when the wait was on
    a collective of the whole group and no single peer is to blame), ``stage`` names the step
    (e.g. ``"dispatch:payload"``).
    """

    def __init__(self, rank: int, peer: Optional[int], stage: str, detail: str = ""):
        self.rank = rank
        self.peer = peer
        self.stage = stage
        self.detail = detail
        who = "the group" if peer is None else f"peer {peer}"
        msg = f"deepcomm: rank {rank} timed out waiting for {who} at stage '{stage}'"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)

    def __reduce__(self):
        # Keep the exception picklable (it crosses process boundaries in launchers and tests).
        return (type(self), (self.rank, self.peer, self.stage, self.detail))
