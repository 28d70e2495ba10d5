"""Why a rank's Buffer broke, told to the other ranks through the process group's store.

A call that fails inside its crossing into the extension after its first exchange may have begun (a failed kernel
launch, a failed put) breaks that rank's Buffer; the other ranks' calls then wait for what it never sent and end in
a ``CommTimeoutError`` after ``timeout_s``. The failing rank writes its reason here once; a rank whose call timed
out reads what its peers wrote and names it in its error, so the job's log says which rank failed first and why,
not only who waited. A rank whose call timed out writes its own timeout here too, first: where the ranks were in
different calls that no exchange compares (docs/troubleshooting.md), each one's timeout then names the stage the
other gave up at, which says which call each was in. Nothing here is on a call's path: the board is written and
read only after an error.
"""
from __future__ import annotations

import time
from typing import Dict, Optional, Sequence

from .errors import CommTimeoutError


# How long a timed-out rank waits at most for the peer it waited for to post (half its timeout_s if that is less):
# ranks whose calls differ time out at about the same time, each timeout_s after entering its own call.
TIMEOUT_GRACE_S = 2.0
POLL_S = 0.05  # how often a timed-out rank looks for the awaited peer's post during its grace


class FailureBoard:
    """One Buffer's board: keys under its number in the group (``deepcomm.rendezvous.wait_for_group``), the same on
    every rank."""

    def __init__(self, store, ranks: Sequence[int], number: int, rank: int):
        self.store, self.rank, self.world = store, rank, len(ranks)
        self.prefix = f"deepcomm/broken/{','.join(map(str, ranks))}/{number}"
        self.posted = False

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/{rank}"

    def post(self, reason: str) -> None:
        """Say why this rank's Buffer broke (once; a store that is gone is not an error of the call)."""
        if self.posted:
            return
        self.posted = True
        try:
            self.store.set(self._key(self.rank), reason)
        except Exception:  # noqa: BLE001 - the call's own error is what the caller raises
            pass

    def reports(self) -> Dict[int, str]:
        """What the other ranks posted, by rank (empty where none did or the store cannot be read)."""
        out = {}
        for r in range(self.world):
            if r == self.rank:
                continue
            try:
                if self.store.check([self._key(r)]):
                    out[r] = self.store.get(self._key(r)).decode(errors="replace")
            except Exception:  # noqa: BLE001 - nothing to add to the timeout then
                return out
        return out

    def _awaited(self, peer: int, grace_s: float) -> None:
        """Wait up to ``grace_s`` for ``peer`` to post (polling its key alone: every rank of a large group may be
        here at once)."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                if self.store.check([self._key(peer)]):
                    return
            except Exception:  # noqa: BLE001 - the store is gone: nothing more will come
                return
            time.sleep(POLL_S)

    def explain(self, error: CommTimeoutError, grace_s: float = 0.0) -> Optional[CommTimeoutError]:
        """``error`` with what the peers reported added to its detail (the peer it waited for first), or None when
        none reported anything. With ``grace_s``, first wait that long at most for the peer ``error`` names to
        post, when it has not yet: a peer that timed out in another call at about the same time posts its own."""
        if grace_s > 0 and error.peer is not None and error.peer != self.rank:
            self._awaited(error.peer, grace_s)
        told = self.reports()
        if not told:
            return None
        order = sorted(told, key=lambda r: (r != error.peer, r))
        said = "; ".join(f"rank {r} reported: {told[r]}" for r in order)
        detail = f"{error.detail}; {said}" if error.detail else said
        return CommTimeoutError(error.rank, error.peer, error.stage, detail)
