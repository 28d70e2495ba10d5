"""Call agreement for launches the host does not wait for (a cached dispatch or a combine on the internode
kernels): the words every rail rank sent at the front of its block (hier_agree.py), or with several GPUs per node
every rank's words the launch took into our strip, are copied into pinned host memory on the stream, right after
the launch, and compared on the host once that copy
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
        """After a launch on the current stream that carried ``fingerprint`` to the rail ranks (one GPU per node:
        every rank): queue the copy of what they sent us."""
        if not any(s != rank for s in rail):
            return
        rows = {s: s for s in rail}  # rank s's words: row s of the receive headers
        self._queue(host_copy(_headers(tr, "recv").contiguous()), tr.device, rows, fingerprint, rank)

    def add_strip(self, comm, fingerprint: Sequence[int]) -> None:
        """After a launch on the current stream that took every rank's words into our strip (several GPUs per
        node: hier_agree.py, the kernels' ``words_at``): queue the copy of the strip."""
        rows = {s: hier_agree.strip_slot(comm, s) for s in range(comm.world_size)}
        self._queue(host_copy(hier_agree.strip_view(comm).contiguous()), comm.device, rows, fingerprint, comm.rank)

    def _queue(self, host: torch.Tensor, device, rows, fingerprint: Sequence[int], rank: int) -> None:
        """``host``: the pinned copy of uint8 headers being made on the current stream; ``rows``: rank -> the row
        of ``host`` that holds its words, for every rank compared (rank order)."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        self._pending.append((done, host, rows, list(fingerprint), rank))

    def collect(self, wait: bool = False) -> None:
        """Compare the pending launches whose copy has run (every one with ``wait``, normally right after a host
        sync); keep the first disagreement."""
        while self._pending:
            done, host, where, fingerprint, rank = self._pending[0]
            if wait:
                done.synchronize()
            elif not done.query():
                return
            self._pending.popleft()
            if self.error is not None:
                continue
            heads = host.view(torch.int32).tolist()  # [rows][WORDS]
            rows = [fingerprint if s == rank else heads[i] for s, i in where.items()]
            try:
                hier_agree.check(rows, fingerprint)
            except ValueError as e:
                self.error = e

    def raise_pending(self) -> None:
        err, self.error = self.error, None
        if err is not None:
            raise err


assert RAIL_HEADER_BYTES == 4 * agreement.WORDS
