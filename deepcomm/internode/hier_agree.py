"""Call agreement in the internode backend's normal mode (deepcomm/agreement.py), in the exchanges every call
makes first, with no round trip of its own:

- a fresh dispatch: its count exchange (``HierComm.all_gather`` of the count row, both hops) carries the words in
  front of the counts, so after it every rank holds every rank's words (any ``gpus_per_node``);
- a cached dispatch, a combine: their first rail exchange (the kernel's round, or ``HierComm.rail_exchange`` of
  the torch routing) carries the words as a ``RAIL_HEADER_BYTES`` header at the front of every rail block, which
  the host reads from the receive slots after the sync that follows the exchange anyway;
- a rejected call (``reject``): the same exchanges with nothing but the words, its REJECTED word set.

With one GPU per node the rail is every rank, so the header is all it takes. With several the words take both
hops of the call, through a strip of ``RAIL_HEADER_BYTES`` per rank at the end of every node GPU's NVLink area
(``strip_bytes``; rail-major slots, ``strip_slot``), so that every rank ends the call's first exchange with every
rank's words:

- fresh dispatch: rail hop first, then its count round's NVLink stage puts every rail rank's words into the strip
  (``put_rail_words``), where they land whatever length the ranks think the count row has;
- cached dispatch: rail hop first (the words in the header), then its NVLink forwarding stage puts every rail
  rank's words into every node GPU's strip; on the torch routing rows go on only where every rank's words heard
  so far are ours;
- combine: NVLink gather first (each rank's own words into every node GPU's strip), then the rail header carries
  the words of every GPU of the node (``MAX_NODE_HEADERS`` headers fit every slot), so our strip (our node) and
  the headers (the other nodes) hold every rank's words; a node that disagreed sends only its words (torch
  routing).

The kernels (csrc/kernels/hier_kernels.hpp, ``words_at``) move the words of a cached dispatch and a combine the
same way inside their one launch, and also copy the other nodes' headers into the strip; the host compares the
strip after the launch (deferred_agree.py). ``check`` raises the reference backend's ValueError (agreement.check),
the same text on every rank. On the kernels calls of different kinds meet safely only with one GPU per node
(docs/troubleshooting.md): a count round and a launch wait on different words.

On the torch routing (``HierComm.node_headers``) calls of every kind meet in the same exchanges: each call's first
exchange is one rail round and one NVLink stage, in either order, so ranks in calls of different kinds stay in
step. There a rail header always has one slot per GPU of the sender's node (``node_header``: the words the sender
has of them, zeros for the others; a dispatch fills its own slot, ``first_header``), and a rank compares the
words it heard (``heard``: its strip and the rail headers). Where the kinds take the hops in different orders (a
combine, NVLink first, on some ranks; a dispatch, rail first, on others) a rank may not hear every rank's words:
it raises the difference among those it heard, naming the ranks whose words did not reach it (``check_heard``).
Every rank does hear a word that differs from its own: a rank whose node and rail all made its call hears,
through a node GPU or a rail rank, the words of any rank on another node and another rail. That holds unless
the waits form a circle: a rail-first rank waits for its rail peers that take the NVLink hop first, and those for
their node peers that take the rail first (at 2 x 2 a "checkerboard": ranks 0 and 3 in dispatches, 1 and 2 in
combines, or the reverse). The ranks in a circle time out. Our strip is zeroed once read, so a slot no rank wrote in a call reads as no words rather than an
earlier call's."""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence

import torch

from .. import agreement
from .._ext import load_extension
from .host_tables import device_table
from .internode_rows import MAX_NODE_HEADERS, RAIL_HEADER_BYTES

assert RAIL_HEADER_BYTES == 4 * agreement.WORDS


def header(fingerprint: Optional[Sequence[int]], device: torch.device) -> torch.Tensor:
    """uint8 ``[RAIL_HEADER_BYTES]`` on ``device``: the words (zeros without a fingerprint), copied without a host
    sync (host_tables.device_table)."""
    words = list(fingerprint) if fingerprint is not None else [0] * agreement.WORDS
    return device_table(words, torch.int32, device).view(torch.uint8)


def node_header(comm, words: Dict[int, Sequence[int]]) -> torch.Tensor:
    """uint8 ``[G * RAIL_HEADER_BYTES]`` on the device (several GPUs per node): slot g holds ``words`` of our
    node's GPU g, zeros where ``words`` has none (without a host sync)."""
    flat: List[int] = []
    for s in comm.node_ranks():
        flat += list(words[s]) if s in words else [0] * agreement.WORDS
    return device_table(flat, torch.int32, comm.device).view(torch.uint8)


def first_header(comm, fingerprint: Optional[Sequence[int]]) -> torch.Tensor:
    """The rail header of a call's first exchange that takes the rail hop first: our words, in our slot of a header
    of our node's GPUs with several per node."""
    if comm.gpus == 1:
        return header(fingerprint, comm.device)
    return node_header(comm, {comm.rank: fingerprint})


def valid(words: Sequence[int]) -> bool:
    """Whether ``words`` are a call's (a slot nothing was written into holds zeros or stale bytes)."""
    return len(words) == agreement.WORDS and words[agreement.Word.MAGIC] == agreement.MAGIC


def _rail_header_rows(comm, m: int) -> List[List[int]]:
    """The G words of the header the rail rank of node ``m`` sent us in the call's first exchange (host)."""
    raw = comm.transport.recv_view(comm.rank_of(m, comm.local), 1, comm.gpus * RAIL_HEADER_BYTES)[0]
    return _as_rows(raw)


def heard(comm, fingerprint: Sequence[int], strip: bool = True) -> Dict[int, List[int]]:
    """Several GPUs per node, after a call's first exchange (rail round and NVLink stage): every rank's words we
    have, by rank: ours, every valid slot of the rail headers in our receive slots and (``strip``) of our strip."""
    known = strip_heard(comm) if strip else {}
    for m in comm.other_nodes:
        for s, w in zip(comm.node_ranks(m), _rail_header_rows(comm, m)):
            if valid(w):
                known.setdefault(s, w)
    known[comm.rank] = list(fingerprint)
    return known


def strip_heard(comm) -> Dict[int, List[int]]:
    """The valid words of our strip, by rank (host: one read of the strip)."""
    return {s: w for s, w in enumerate(_as_rows(strip_words(comm))) if valid(w)}


def check_heard(comm, known: Dict[int, List[int]], fingerprint: Sequence[int]) -> None:
    """``check`` over the words heard (``heard``). Every rank's: the reference text. Some ranks' words missing
    (calls of different kinds, see above): the difference among the words heard, naming the ranks not heard from;
    no difference among them: a ValueError naming those ranks as sending no fingerprint."""
    if fingerprint[agreement.Word.REJECTED]:
        return
    R = comm.world_size
    if len(known) == R:
        agreement.check([known[s] for s in range(R)])
        return
    missing = [s for s in range(R) if s not in known]
    mine = list(fingerprint)
    if all(w == mine for w in known.values()):
        agreement.check([known.get(s, [0] * agreement.WORDS) for s in range(R)])
    ranks = sorted(known)
    try:
        agreement.check([known[s] for s in ranks], ranks)
    except ValueError as e:
        names = ", ".join(map(str, missing))
        raise ValueError(f"{e} (the words of rank{'s' if len(missing) > 1 else ''} {names} did not reach this "
                         "rank: calls of different kinds take the NVLink and rail hops in different orders)") from None


def clear_strip(comm) -> None:
    """Zero our strip once read (on the stream), so a slot no rank writes in a later call is read as no words."""
    if comm.gpus > 1:
        strip_view(comm).zero_()


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


# ---- several GPUs per node: the strip of words in every node GPU's NVLink area ----------------------------------
# One header per rank, rail-major, as the extension lays it out (WordsStrip, csrc/runtime/internode_layout.hpp):
# the words of one rail are contiguous (one put per node GPU in a count round, one run per rail in the kernels).
@functools.lru_cache(maxsize=64)
def _strip(num_nodes: int, gpus: int, area_bytes: int) -> dict:
    return load_extension().words_strip(num_nodes, gpus, area_bytes)


def strip_bytes(world_size: int) -> int:
    """Bytes the NVLink area of each rank needs past its rows: one header per rank."""
    return _strip(world_size, 1, world_size * RAIL_HEADER_BYTES)["bytes"]


def strip_at(comm) -> int:
    """Byte offset of the strip in every node GPU's area (the kernels' ``words_at``)."""
    return _strip(comm.num_nodes, comm.gpus, comm.link.area_bytes)["at"]


def strip_slot(comm, s: int) -> int:
    """Rank ``s``'s slot in the strip."""
    return _strip(comm.num_nodes, comm.gpus, comm.link.area_bytes)["slots"][s]


def _as_rows(raw: torch.Tensor) -> List[List[int]]:
    """int lists of ``WORDS`` words from uint8 bytes (whole headers)."""
    return raw.cpu().contiguous().view(torch.int32).view(-1, agreement.WORDS).tolist()


def strip_view(comm) -> torch.Tensor:
    """Our strip, uint8 ``[R, RAIL_HEADER_BYTES]`` in slot order (a view of our area)."""
    at = strip_at(comm)
    return comm.node_area()[at:at + strip_bytes(comm.world_size)].view(comm.world_size, RAIL_HEADER_BYTES)


def put_words(comm, words: Dict[int, Sequence[int]]) -> None:
    """Inside an NVLink stage (``comm.node_hop``): rank s's ``words[s]`` into slot [s] of every node GPU's strip
    (nothing with one GPU per node)."""
    if comm.gpus == 1:
        return
    at = strip_at(comm)
    for s, w in words.items():
        head = header(w, comm.device)
        for g in range(comm.gpus):
            comm.link.put(g, at + strip_slot(comm, s) * RAIL_HEADER_BYTES, head)


def put_rail_words(comm, hop, rail_rows: torch.Tensor) -> None:
    """Inside the NVLink stage of a count round (``HierComm.all_gather`` with words, several GPUs per node): every
    rail rank's words into its slots of every node GPU's strip, one put per node GPU, on the device (no host
    sync). With ``comm.node_headers`` (the round carried ``first_header``) from its slot of the header it sent us
    (ours: our row's), which holds them whatever kind of call it made; else from the first
    ``RAIL_HEADER_BYTES`` of its row (``rail_rows``: uint8 ``[N, stride]``, nodes ascending). Either way the words'
    place does not depend on the count row's length, which ranks that disagree (num_experts) get wrong."""
    tr, l, G, H = comm.transport, comm.local, comm.gpus, RAIL_HEADER_BYTES
    if comm.node_headers:
        block = torch.cat([rail_rows[m:m + 1, :H] if m == comm.node
                           else tr.recv_view(comm.rank_of(m, l), 1, G * H)[:, l * H:(l + 1) * H]
                           for m in range(comm.num_nodes)])
    else:
        block = rail_rows[:, :H].contiguous()
    at = strip_at(comm) + strip_slot(comm, comm.rank_of(0, comm.local)) * H
    for g in range(comm.gpus):
        hop.put(g, at, block)


def strip_words(comm) -> torch.Tensor:
    """uint8 ``[R, RAIL_HEADER_BYTES]``: every rank's words from our strip, rank order (on the device, no sync)."""
    G, N = comm.gpus, comm.num_nodes  # slot l * N + m -> rank m * G + l
    return strip_view(comm).view(G, N, RAIL_HEADER_BYTES).transpose(0, 1).reshape(comm.world_size, RAIL_HEADER_BYTES)


def _strip_rows(comm, ranks: Sequence[int]) -> List[List[int]]:
    return _as_rows(strip_view(comm)[[strip_slot(comm, s) for s in ranks]])


def _agree(rows, fingerprint: Sequence[int]) -> bool:
    mine = list(fingerprint)
    return all(list(r) == mine for r in rows)


def fresh_check(comm, rows: List[List[int]], fingerprint: Sequence[int]) -> None:
    """After a fresh dispatch's count round: ``rows`` every rank's words as the round gathered them (rank order).
    Several GPUs per node on the torch routing: with the rail headers' words too (``check_heard``)."""
    if comm.gpus == 1 or not comm.node_headers:
        check(rows, fingerprint)
        return
    known = heard(comm, fingerprint, strip=False)
    for s, w in enumerate(rows):
        if valid(w):
            known.setdefault(s, w)
    check_heard(comm, known, fingerprint)


def dispatch_rail(comm, fingerprint: Sequence[int]) -> Dict[int, List[int]]:
    """A cached dispatch, after its rail exchange: every rank's words we have by rank (every rail rank's, and
    with several GPUs per node what the headers held of the other GPUs of their nodes). One GPU per node: compared
    here (ValueError on every rank); else forwarded in the NVLink stage (``put_words``) and compared after it."""
    if comm.gpus == 1:
        rows = rail_rows(comm.transport, comm.rail(), comm.rank, fingerprint)
        check(rows, fingerprint)
        return dict(zip(comm.rail(), rows))
    return heard(comm, fingerprint, strip=False)


def rail_words(comm, known: Dict[int, List[int]]) -> Dict[int, List[int]]:
    """The words of our rail's ranks among ``known`` (what a cached dispatch's NVLink stage puts into the strip)."""
    return {s: known[s] for s in comm.rail() if s in known}


def rail_agrees(comm, known: Dict[int, List[int]], fingerprint: Sequence[int]) -> bool:
    """Whether every rail rank, and every other rank heard from, made our call (rows are then safe to forward)."""
    return all(s in known for s in comm.rail()) and _agree(known.values(), fingerprint)


def check_strip(comm, known: Dict[int, List[int]], fingerprint: Sequence[int]) -> None:
    """After the NVLink stage of a cached dispatch (several GPUs per node): every rank's words from our strip, then
    those of ``known`` (the rail headers' words, read once by ``dispatch_rail``) for ranks the strip did not give;
    the strip is zeroed after."""
    if comm.gpus > 1:
        every = strip_heard(comm)
        clear_strip(comm)
        for s, w in known.items():
            every.setdefault(s, w)
        every[comm.rank] = list(fingerprint)
        check_heard(comm, every, fingerprint)


def combine_header(comm, fingerprint: Sequence[int]) -> torch.Tensor:
    """The rail header of a combine: our words, or (several GPUs per node, after the gather stage put every node
    GPU's words into our strip) the words of every GPU of our node, local index order."""
    if comm.gpus == 1:
        return header(fingerprint, comm.device)
    assert comm.gpus <= MAX_NODE_HEADERS
    return strip_view(comm)[[strip_slot(comm, s) for s in comm.node_ranks()]].reshape(-1)


def node_agrees(comm, fingerprint: Sequence[int]) -> bool:
    """After a combine's gather stage: whether every GPU of our node made our call (always with one GPU)."""
    return comm.gpus == 1 or _agree(_strip_rows(comm, comm.node_ranks()), fingerprint)


def combine_check(comm, fingerprint: Sequence[int]) -> None:
    """After a combine's rail exchange: every rank's words (one GPU per node: the rail headers; several: our
    node's from our strip, every other node's from the header its rail rank sent us, ``heard``), compared; the
    strip is zeroed after."""
    if comm.gpus == 1:
        check(rail_rows(comm.transport, comm.rail(), comm.rank, fingerprint), fingerprint)
        return
    known = heard(comm, fingerprint)
    clear_strip(comm)
    check_heard(comm, known, fingerprint)


def combine_disagreed(comm, fingerprint: Sequence[int], stage: str = "combine:rdma") -> None:
    """A combine whose node disagreed (``node_agrees`` False; or a rejected one): the rail exchange with nothing
    but the node's words, then the check (ValueError, unless our own words are rejected)."""
    comm.rail_exchange({}, {m: 0 for m in comm.other_nodes}, stage, header=combine_header(comm, fingerprint))
    combine_check(comm, fingerprint)


def join_rejected(comm, fingerprint: Sequence[int]) -> None:
    """A call this rank rejected (``fingerprint``'s REJECTED word set): the exchanges the peers' call makes first,
    with nothing but the words, so they read them and raise naming this rank. One GPU per node: one rail exchange
    with the header. Several: a rejected combine makes the torch routing's gather stage and rail exchange; a
    rejected dispatch the count round (rail exchange and NVLink stage) of a row of its words, which puts every
    rail rank's words into every node GPU's strip, where a fresh dispatch's count round and a cached dispatch of
    the torch routing read them. (A rejected cached dispatch or combine on the kernels launches the kernel
    instead: HierKernels.reject.)"""
    if comm.gpus == 1:
        comm.rail_exchange({}, {m: 0 for m in comm.other_nodes}, "agree:reject",
                           header=header(fingerprint, comm.device))
        return
    if fingerprint[agreement.Word.OP] == agreement.Op.COMBINE:
        with comm.node_hop("agree:reject"):
            put_words(comm, {comm.rank: fingerprint})
        combine_disagreed(comm, fingerprint, "agree:reject")
        return
    # a dispatch: the count round of a fresh one (words, then zeros); its words land in every node GPU's strip,
    # where a fresh dispatch's count round (HierComm.all_gather with words) and a cached one read them
    row = torch.zeros(agreement.WORDS + comm.world_size, dtype=torch.int32, device=comm.device)
    row[:agreement.WORDS] = header(fingerprint, comm.device).view(torch.int32)
    comm.all_gather(row, "agree:reject", words=fingerprint)
