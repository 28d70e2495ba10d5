"""Call agreement in the internode backend's normal mode (deepcomm/agreement.py), in the exchanges every call
makes first, with no round trip of its own:

- a fresh dispatch: its count exchange (``HierComm.all_gather`` of the count row, both hops) carries the words in
  front of the counts, so after it every rank holds every rank's words (any ``gpus_per_node``);
- a cached dispatch, a combine: their first rail exchange (the kernel's round, or ``HierComm.rail_exchange`` of
  the torch routing) carries the words as a ``RAIL_HEADER_BYTES`` header at the front of every rail block, which
  the host reads from the receive slots after the sync that follows the exchange anyway;
- a rejected call (``reject``): the same exchanges with nothing but the words, its REJECTED word set.

With one GPU per node the rail is every rank, so the header is all it takes. With several (torch routing only:
the kernels' NVLink hop carries no words yet, backend.py) the words take both hops of the call, through a strip
of ``RAIL_HEADER_BYTES`` per rank at the end of every node GPU's NVLink area (``strip_bytes``):

- cached dispatch: rail hop first (each rank's own words in the header), then its NVLink forwarding stage puts
  every rail rank's words into slot [rank] of every node GPU's strip, so the strip holds every rank's words;
  rows go on only from a rail that agreed with us (``rail_agrees``), and the check reads the strip;
- combine: NVLink gather first (each rank's own words into every node GPU's strip), then the rail header carries
  the words of every GPU of the node (``MAX_NODE_HEADERS`` headers fit every slot), so our strip (our node) and
  the headers (the other nodes) hold every rank's words; a node that disagreed sends only its words.

``check`` raises the reference backend's ValueError (agreement.check), the same text on every rank, before any
output is made. Calls of different kinds meet safely only with one GPU per node (docs/troubleshooting.md)."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from .. import agreement
from ..cuda.align import round_up
from .host_tables import device_table
from .internode_rows import MAX_NODE_HEADERS, RAIL_HEADER_BYTES

assert RAIL_HEADER_BYTES == 4 * agreement.WORDS


def header(fingerprint: Optional[Sequence[int]], device: torch.device) -> torch.Tensor:
    """uint8 ``[RAIL_HEADER_BYTES]`` on ``device``: the words (zeros without a fingerprint), copied without a host
    sync (host_tables.device_table)."""
    words = list(fingerprint) if fingerprint is not None else [0] * agreement.WORDS
    return device_table(words, torch.int32, device).view(torch.uint8)


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


def rejected_words(fingerprint: Sequence[int], error: BaseException) -> agreement.Fingerprint:
    """The words of this call once this rank's backend refused it (``error``) before its first exchange."""
    op, call, buffer = (fingerprint[agreement.Word.OP], fingerprint[agreement.Word.CALL],
                        fingerprint[agreement.Word.BUFFER])
    return agreement.make(op, call, buffer, rejected=agreement.reject_code(error))


# ---- several GPUs per node: the strip of words in every node GPU's NVLink area ----------------------------------
def strip_bytes(world_size: int) -> int:
    """Bytes the NVLink area of each rank needs past its rows: one header per rank."""
    return world_size * RAIL_HEADER_BYTES


def _strip_at(comm) -> int:
    return comm.link.area_bytes - strip_bytes(comm.world_size)


def _as_rows(raw: torch.Tensor) -> List[List[int]]:
    """int lists of ``WORDS`` words from uint8 bytes (whole headers)."""
    return raw.cpu().contiguous().view(torch.int32).view(-1, agreement.WORDS).tolist()


def put_words(comm, words: Dict[int, Sequence[int]]) -> None:
    """Inside an NVLink stage (``comm.node_hop``): rank s's ``words[s]`` into slot [s] of every node GPU's strip
    (nothing with one GPU per node)."""
    if comm.gpus == 1:
        return
    at = _strip_at(comm)
    for s, w in words.items():
        head = header(w, comm.device)
        for g in range(comm.gpus):
            comm.link.put(g, at + s * RAIL_HEADER_BYTES, head)


def _strip_rows(comm, ranks: Sequence[int]) -> List[List[int]]:
    at = _strip_at(comm)
    raw = comm.node_area()[at:at + strip_bytes(comm.world_size)].view(comm.world_size, RAIL_HEADER_BYTES)
    return _as_rows(raw[list(ranks)])


def _agree(rows: List[List[int]], fingerprint: Sequence[int]) -> bool:
    mine = list(fingerprint)
    return all(list(r) == mine for r in rows)


def dispatch_rail(comm, fingerprint: Sequence[int]) -> Dict[int, List[int]]:
    """A cached dispatch, after its rail exchange: every rail rank's words by rank. One GPU per node: compared
    here (ValueError on every rank); else forwarded in the NVLink stage (``put_words``) and compared after it."""
    rows = rail_rows(comm.transport, comm.rail(), comm.rank, fingerprint)
    if comm.gpus == 1:
        check(rows, fingerprint)
    return dict(zip(comm.rail(), rows))


def rail_agrees(rail: Dict[int, List[int]], fingerprint: Sequence[int]) -> bool:
    """Whether every rail rank made our call (their rows are then safe to forward)."""
    return _agree(list(rail.values()), fingerprint)


def check_strip(comm, fingerprint: Sequence[int]) -> None:
    """After the NVLink stage of a cached dispatch (several GPUs per node): every rank's words from our strip."""
    if comm.gpus > 1:
        check(_strip_rows(comm, range(comm.world_size)), fingerprint)


def combine_header(comm, fingerprint: Sequence[int]) -> torch.Tensor:
    """The rail header of a combine: our words, or (several GPUs per node, after the gather stage put every node
    GPU's words into our strip) the words of every GPU of our node, local index order."""
    if comm.gpus == 1:
        return header(fingerprint, comm.device)
    assert comm.gpus <= MAX_NODE_HEADERS
    at = _strip_at(comm) + comm.node_ranks()[0] * RAIL_HEADER_BYTES
    return comm.node_area()[at:at + comm.gpus * RAIL_HEADER_BYTES].clone()


def node_agrees(comm, fingerprint: Sequence[int]) -> bool:
    """After a combine's gather stage: whether every GPU of our node made our call (always with one GPU)."""
    return comm.gpus == 1 or _agree(_strip_rows(comm, comm.node_ranks()), fingerprint)


def combine_rows(comm, fingerprint: Sequence[int]) -> List[List[int]]:
    """After a combine's rail exchange: every rank's words, by rank (our node's from our strip, every other
    node's from the header its rail rank sent us)."""
    G = comm.gpus
    if G == 1:
        return rail_rows(comm.transport, comm.rail(), comm.rank, fingerprint)
    rows: List[List[int]] = []
    for m in range(comm.num_nodes):
        if m == comm.node:
            rows += _strip_rows(comm, comm.node_ranks())
        else:
            rows += _as_rows(comm.transport.recv_view(comm.rank_of(m, comm.local), 1, G * RAIL_HEADER_BYTES)[0])
    return rows


def combine_disagreed(comm, fingerprint: Sequence[int], stage: str = "combine:rdma") -> None:
    """A combine whose node disagreed (``node_agrees`` False; or a rejected one): the rail exchange with nothing
    but the node's words, then the check (ValueError, unless our own words are rejected)."""
    comm.rail_exchange({}, {m: 0 for m in comm.other_nodes}, stage, header=combine_header(comm, fingerprint))
    check(combine_rows(comm, fingerprint), fingerprint)


def join_rejected(comm, fingerprint: Sequence[int]) -> None:
    """A call this rank rejected (``fingerprint``'s REJECTED word set): the exchanges the peers' call makes first,
    with nothing but the words, so they read them and raise naming this rank. One GPU per node: one rail exchange
    with the header. Several: a rejected combine makes the combine's gather stage and rail exchange; a rejected
    dispatch the rail exchange of a count row (words, then zeros) and an NVLink stage that puts every rail rank's
    row where a fresh dispatch's count exchange puts it and its words into the strip, where a cached dispatch
    reads them."""
    if comm.gpus == 1:
        comm.rail_exchange({}, {m: 0 for m in comm.other_nodes}, "agree:reject",
                           header=header(fingerprint, comm.device))
        return
    if fingerprint[agreement.Word.OP] == agreement.Op.COMBINE:
        with comm.node_hop("agree:reject"):
            put_words(comm, {comm.rank: fingerprint})
        combine_disagreed(comm, fingerprint, "agree:reject")
        return
    # the count row of a fresh dispatch with several GPUs per node: words, counts per rank, counts per node
    stride = round_up(4 * (agreement.WORDS + comm.world_size + comm.num_nodes), 16)
    row = torch.zeros(stride, dtype=torch.uint8, device=comm.device)
    row[:RAIL_HEADER_BYTES] = header(fingerprint, comm.device)
    got = comm.rail_exchange({m: [row] for m in comm.other_nodes}, {m: stride for m in comm.other_nodes},
                             "agree:reject")
    rows = {s: row if s == comm.rank else got[m][:stride] for m, s in enumerate(comm.rail())}
    with comm.node_hop("agree:reject:node") as hop:
        for s, r in rows.items():
            for g in range(comm.gpus):
                hop.put(g, s * stride, r.view(1, stride))
        put_words(comm, {s: _as_rows(r[:RAIL_HEADER_BYTES])[0] for s, r in rows.items()})
