"""Call agreement for launches the host does not wait for (a cached dispatch or a combine on the internode
kernels): the words every rail rank sent at the front of its block (hier_agree.py) are copied from our receive
slots into pinned host memory on the stream, right after the launch, and compared on the host once that copy
has run: at a later call (when its event says so, no wait), after a fresh dispatch's count wait, or in
synchronize(). A disagreement is the ValueError of agreement.check, the reference backend's text; the backend
raises it after the call in progress has made its exchange, so every rank stays in step (as the NVLink backend
raises the input errors its kernels record: deepcomm/cuda/call_errors.py). The header going out is written the
same way, without a host sync."""
from __future__ import annotations

import collections
from typing import Optional, Sequence

import torch

from .. import agreement
from . import hier_agree
from .host_tables import host_copy
from .internode_rows import RAIL_HEADER_BYTES


def _headers(tr, area: str) -> torch.Tensor:
    """uint8 ``[R, RAIL_HEADER_BYTES]``: the front of every rank's section (``area="send"``) or receive slot
    (``"recv"``), a strided view of the transport's memory."""
    R, o = tr.world_size, tr.offsets[area]
    return tr.region[o:o + R * tr.slot_bytes].view(R, tr.slot_bytes)[:, :RAIL_HEADER_BYTES]


def write_headers(tr, fingerprint: Sequence[int], device: torch.device) -> None:
    """The words at the front of every section of the send area (one strided copy on the current stream, no host
    sync). Only the rail ranks' sections are posted; the other sections' fronts are never read."""
    words = hier_agree.header(fingerprint, device)  # [RAIL_HEADER_BYTES]
    _headers(tr, "send").copy_(words.expand(tr.world_size, RAIL_HEADER_BYTES))


class DeferredAgreement:
    """The launches whose rail headers are still to be compared, oldest first, and the first disagreement found
    (kept for ``raise_pending``)."""

    def __init__(self):
        self._pending: collections.deque = collections.deque()
        self.error: Optional[ValueError] = None

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, tr, rail: Sequence[int], rank: int, fingerprint: Sequence[int]) -> None:
        """After a launch on the current stream that carried ``fingerprint`` to the rail ranks: queue the copy of
        what they sent us."""
        if not any(s != rank for s in rail):
            return
        host = host_copy(_headers(tr, "recv").contiguous())
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(tr.device))
        self._pending.append((done, host, list(rail), list(fingerprint), rank))

    def collect(self, wait: bool = False) -> None:
        """Compare the pending launches whose copy has run (every one with ``wait``, normally right after a host
        sync); keep the first disagreement."""
        while self._pending:
            done, host, rail, fingerprint, rank = self._pending[0]
            if wait:
                done.synchronize()
            elif not done.query():
                return
            self._pending.popleft()
            if self.error is not None:
                continue
            heads = host.view(torch.int32).tolist()  # [R][WORDS], every rank's slot (ours unused)
            rows = [fingerprint if s == rank else heads[s] for s in rail]
            try:
                hier_agree.check(rows, fingerprint)
            except ValueError as e:
                self.error = e

    def raise_pending(self) -> None:
        err, self.error = self.error, None
        if err is not None:
            raise err


assert RAIL_HEADER_BYTES == 4 * agreement.WORDS
