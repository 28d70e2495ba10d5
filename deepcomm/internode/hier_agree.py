"""Call agreement in the internode backend's normal mode (deepcomm/agreement.py), in the RDMA exchange every call
makes first, with no round trip of its own:

- a fresh dispatch: its count exchange (``HierComm.all_gather`` of the count row) carries the words in front of
  the counts, so after it every rank holds every rank's words (both hops: any ``gpus_per_node``);
- a cached dispatch, a combine: their first rail exchange (the kernel's round, or ``HierComm.rail_exchange`` of
  the torch routing) carries the words as a ``RAIL_HEADER_BYTES`` header at the front of every rail block, which
  the host reads from the receive slots after the sync that follows the exchange anyway;
- a rejected call (``reject``): one rail exchange with nothing but the header, its REJECTED word set.

Every first exchange is one round of the same transport, with the words at byte 0 of each rail block, so any
two calls that meet pair up and read each other's words. The rail exchange reaches only the ranks of our local
index; the header carries every rank's words only with one GPU per node, where the rail is every rank (the
backend compares only there, backend.py). ``check`` raises the reference backend's ValueError (agreement.check),
the same text on every rank, before any output is made."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from .. import agreement
from .internode_rows import RAIL_HEADER_BYTES

assert RAIL_HEADER_BYTES == 4 * agreement.WORDS


def header(fingerprint: Optional[Sequence[int]], device: torch.device) -> torch.Tensor:
    """uint8 ``[RAIL_HEADER_BYTES]``: the words (zeros without a fingerprint)."""
    words = torch.zeros(agreement.WORDS, dtype=torch.int32)
    if fingerprint is not None:
        words[:] = torch.tensor(list(fingerprint), dtype=torch.int32)
    return words.view(torch.uint8).to(device)


def check(rows: List[Sequence[int]], fingerprint: Sequence[int]) -> None:
    """``rows[r]``: rank r's words. ValueError (agreement.check) unless every rank made the same call, except on a
    rank whose own words are rejected: it raises its own error after this (as in the reference backend)."""
    if not fingerprint[agreement.Word.REJECTED]:
        agreement.check(rows)


def rail_rows(tr, rail: Sequence[int], rank: int, fingerprint: Sequence[int]) -> List[List[int]]:
    """Each rail rank's words, rail order: ours, and the header at the front of every other rail rank's block in
    our receive slots (after the exchange has landed and synchronized)."""
    others = [s for s in rail if s != rank]
    heads = (torch.stack([tr.recv_view(s, 1, RAIL_HEADER_BYTES)[0] for s in others]).cpu().view(torch.int32)
             .tolist() if others else [])
    got = dict(zip(others, heads))
    return [list(fingerprint) if s == rank else got[s] for s in rail]


def write_sections(tr, rail: Sequence[int], rank: int, fingerprint: Optional[Sequence[int]],
                   device: torch.device) -> None:
    """The header at the front of the kernels' send section for every other rail rank (section d at
    ``d * slot_bytes`` of the send area), on the current stream, before the launch that sends them."""
    head = header(fingerprint, device)
    o = tr.offsets["send"]
    for d in rail:
        if d != rank:
            at = o + d * tr.slot_bytes
            tr.region[at:at + RAIL_HEADER_BYTES].copy_(head)


def rejected_words(fingerprint: Sequence[int], error: BaseException) -> agreement.Fingerprint:
    """The words of this call once this rank's backend refused it (``error``) before its first exchange."""
    op, call, buffer = (fingerprint[agreement.Word.OP], fingerprint[agreement.Word.CALL],
                        fingerprint[agreement.Word.BUFFER])
    return agreement.make(op, call, buffer, rejected=agreement.reject_code(error))


def join_rejected(comm, fingerprint: Sequence[int]) -> None:
    """A call this rank rejected (``fingerprint``'s REJECTED word set): one rail exchange with nothing but the
    header, the round the peers' call makes first, so they read the words and raise naming this rank."""
    comm.rail_exchange({}, {m: 0 for m in comm.other_nodes}, "agree:reject",
                       header=header(fingerprint, comm.device))
