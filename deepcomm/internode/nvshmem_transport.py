"""The internode exchange round through NVSHMEM's host API (``internode_transport="nvshmem"``): the same round as
NicTransport (deepcomm/internode/backend.py), with NVSHMEM's stream-ordered put-with-signal in place of GPU-posted
WQEs, so the hierarchical communicator (hier_comm.py) and the dispatch/combine built on it run unchanged
(docs/internode.md, "Transports"). Like NicTransport it exchanges only with its ``peers`` (the internode path:
the ranks of our local index on the other nodes, "rail" peers); a round sends nothing to, and waits on nothing
from, any other rank.

The registered memory is one block of NVSHMEM's symmetric heap per rank: every rank's block has the same
offsets, so "peer p's receive slot for us" is *our* address of that slot, handed to NVSHMEM with ``pe = p``.

One round r (every rank, collective), all on the caller's current stream; "peer" means a rank of ``peers``:
  1. credit: for each peer p, ``signal_op(credit[me] on p := r)``: "my slot for you is free" (stream-ordered
     after our copy-out of round r - 1);
  2. a bounded wait kernel: our credit[p] >= r for every peer (stage ``nvshmem:credit``); the host then syncs and
     checks the error record, so no put leaves for a peer whose slot may still be read;
  3. for each peer p, ``putmem_signal(recv[me] on p := our block for p, signal[me] on p := r)``; a zero-byte
     block sends the signal alone (``signal_op``);
  4. ``quiet``, then a bounded wait kernel: our signal[p] >= r for every peer (stage ``nvshmem:signal``): every
     peer's block for us has landed; the host syncs and raises CommTimeoutError if a wait timed out.
NVSHMEM's own ``signal_wait_until_on_stream`` is not used: it cannot give up on a missing peer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..cuda.arena import as_device_bytes
from .exchange_record import ExchangeRecord, check_round, peer_list
from .internode_layout import nvshmem_region
from .internode_rows import rail_slot_bytes

TOTAL_FIELDS = ("credits", "puts", "signals", "bytes")  # per peer, counted on the host as issued


def region_layout(world_size: int, slot_bytes: int) -> Tuple[Dict[str, int], int]:
    """Offsets of the parts of a rank's symmetric block, and its size (NvshmemRegion,
    csrc/runtime/internode_layout.hpp; 256-byte aligned parts):
        signal  u64 [R]            signal[s]: the last round whose block from s has landed here
        credit  u64 [R]            credit[s]: the last round for which s has freed its receive slot for us
        send    bytes [R * slot]   our packed rows, grouped by destination
        recv    bytes [R][slot]    recv[s]: the block rank s sent us this round
    ValueError for ``world_size`` outside 1..INTERNODE_MAX_RANKS or a ``slot_bytes`` not a multiple of 16.
    """
    lay = nvshmem_region(world_size, slot_bytes)
    return {name: lay[name] for name in ("signal", "credit", "send", "recv")}, lay["total"]


@dataclass(frozen=True)
class Op:
    """One stream-ordered NVSHMEM call of a round. ``kind``: "credit" and "signal" are ``signal_op`` (no data);
    "put" is ``putmem_signal`` of ``nbytes`` from ``source`` to ``dest``. Addresses are this rank's symmetric
    addresses (NVSHMEM writes the same offset on ``pe``); every signal is a SET to ``value``."""
    kind: str
    pe: int
    sig_addr: int
    value: int
    dest: int = 0
    source: int = 0
    nbytes: int = 0


def credit_ops(base: int, offsets: Dict[str, int], rank: int, world_size: int, round_: int,
               peers: Optional[Sequence[int]] = None) -> List[Op]:
    """Step 1: tell every peer p (``peers``, default every other rank) that our receive slot for it is free for
    round ``round_`` (p's credit[rank])."""
    return [Op("credit", p, base + offsets["credit"] + 8 * rank, round_) for p in peer_list(rank, world_size, peers)]


def block_ops(base: int, offsets: Dict[str, int], slot_bytes: int, rank: int, world_size: int, round_: int,
              send_bytes: Sequence[int], send_begin: Sequence[int], peers: Optional[Sequence[int]] = None) -> List[Op]:
    """Step 3: our block for every peer p (``peers``, default every other rank; bytes [send_begin[p],
    + send_bytes[p]) of the send area) into p's receive slot for us, then p's signal[rank] := round; a zero-byte
    block is the signal alone. ``send_bytes`` must be 0 for a rank that is not a peer. Checks every size first
    (``ValueError``), so nothing is issued for a bad round."""
    targets = peer_list(rank, world_size, peers)
    check_round(send_bytes, send_begin, rank, world_size, targets, slot_bytes)
    ops = []
    for p in targets:
        sig = base + offsets["signal"] + 8 * rank
        n = int(send_bytes[p])
        if n == 0:
            ops.append(Op("signal", p, sig, round_))
        else:
            ops.append(Op("put", p, sig, round_, dest=base + offsets["recv"] + rank * slot_bytes,
                          source=base + offsets["send"] + int(send_begin[p]), nbytes=n))
    return ops


class NvshmemTransport(ExchangeRecord):
    """This rank's symmetric block (counters, send area, receive slots), the error record its wait kernels
    report to, and the round counter. Same interface as NicTransport for HierComm and InternodeBackend, ``peers``
    included (every other rank by default). Collective construction (allocates on NVSHMEM's heap, initializing
    NVSHMEM over ``group`` if needed); every rank must pass a symmetric peer relation (p in our peers exactly
    when we are in p's), as the rail relation is.

    The block keeps one receive slot per rank (indexed by the sender's rank, the same offsets on every rank), of
    which only the peers' are written; slots are sized like NicTransport's (``rail_slot_bytes``: the widest RDMA
    row of the hierarchical path, an fp32 combine partial, per token)."""

    def __init__(self, C, group, rank: int, world_size: int, device: torch.device, max_tokens: int, hidden: int,
                 timeout_s: float, peers: Optional[Sequence[int]] = None, signals_per_round: int = 1):
        from ..cuda.nvshmem_library import load_library
        from ..cuda.nvshmem_memory import NvshmemMemory

        self.peers = peer_list(rank, world_size, peers)  # ValueError before any collective
        limit = C.transport.INTERNODE_MAX_RANKS
        if not 2 <= world_size <= limit:
            raise ValueError(f"world_size: the NVSHMEM internode transport takes 2..{limit} ranks, got {world_size}")
        if signals_per_round < 1:
            raise ValueError(f"signals_per_round: expected >= 1, got {signals_per_round}")
        # A round r has landed when signal[p] reaches r * signals_per_round: 1 here; the internode kernels' device
        # puts add 1 per chunk (hier_kernels.hpp kNvshmemChunks), so their transport's host rounds SET that value.
        self.signals_per_round = signals_per_round
        self.n = load_library()  # NvshmemUnavailableError, before any collective, when NVSHMEM is missing
        self.C, self.T = C, C.transport
        self.rank, self.world_size, self.device, self.timeout_s = rank, world_size, device, timeout_s
        self.slot_bytes = rail_slot_bytes(max_tokens, hidden)
        self.offsets, self.region_bytes = region_layout(world_size, self.slot_bytes)
        self.err_host = 0
        self.region = None
        self._device_rounds = None  # deepcomm._nvshmem_kernels once issue_rounds_from() is called
        self.mem = NvshmemMemory(C, group, rank, world_size, self.region_bytes, map_peers=False)  # zeroed, barrier
        try:
            self.base = self.mem.ptr
            self.region = as_device_bytes(self.base, self.region_bytes, device, owner=self.mem)
            self.err_host, self.err_dev = C.host_mapped_alloc(C.error_record_bytes())
            C.clear_error(self.err_host)
            self.round = 0
            self.broken = False
            self.totals = {p: dict.fromkeys(TOTAL_FIELDS, 0) for p in self.peers}
            torch.cuda.synchronize(device)
            dist.barrier(group=group)
        except BaseException:
            self.close()
            raise

    def counters(self, name: str) -> List[int]:
        """Our ``signal`` or ``credit`` words, one per rank (host copy; for tests and post-mortems; a rank that is
        not a peer never raises its words: they stay 0)."""
        o = self.offsets[name]
        return self.region[o:o + 8 * self.world_size].view(torch.int64).tolist()

    # ---- one round ----
    def exchange(self, send_bytes: Sequence[int], send_begin: Sequence[int], wait: bool = True) -> None:
        """Send bytes [send_begin[d], + send_bytes[d]) of the send area to every peer d, into d's receive slot
        for us (``send_bytes[d]`` must be 0 for a rank that is not a peer: ValueError); return once every peer's
        block for us has landed (synchronizes the device, raises CommTimeoutError if a wait timed out).
        ``wait=False``: that sync is left to the caller (who then calls ``check_error()``). The host-API round
        also syncs after its credit wait, whatever ``wait`` says: no put may leave for a peer whose slot may still
        be read; a round issued from the GPU (``issue_rounds_from``) waits for the credits inside its launch and
        queues the whole round without a sync. Collective: every rank calls it the same number of times."""
        self.refuse_if_broken()
        r = self.round + 1
        landed = r * self.signals_per_round
        blocks = block_ops(self.base, self.offsets, self.slot_bytes, self.rank, self.world_size, landed, send_bytes,
                           send_begin, self.peers)
        credits = credit_ops(self.base, self.offsets, self.rank, self.world_size, r, self.peers)
        self.round = r
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device)
            if self._device_rounds:
                self._launch_round(r, landed, send_bytes, send_begin, stream.cuda_stream)
                for op in credits + blocks:
                    self._count(op)
            else:
                self._issue(credits, stream.cuda_stream)
                self._wait("credit", r, stream.cuda_stream)
                stream.synchronize()
                self.check_error()  # a peer that never freed its slot: raise before writing into it
                self._issue(blocks, stream.cuda_stream)
                self.n.quiet_on_stream(stream.cuda_stream)
            self._wait("signal", landed, stream.cuda_stream)
            if not wait:
                return
            stream.synchronize()
        self.check_error()

    def issue_rounds_from(self, kernels) -> None:
        """Issue every later round from the GPU (``kernels``: deepcomm._nvshmem_kernels, its device state
        registered; its ``rail_round`` launch, csrc/nvshmem_kernels/rail_round.hpp): the same credits, bounded
        credit waits and puts-with-signal as the host-API round, in one launch, so a round costs the host no
        sync (``exchange(wait=False)`` then queues it whole). More peers than one launch takes keep the host
        round."""
        self._device_rounds = kernels if len(self.peers) <= kernels.RAIL_ROUND_MAX_PEERS else None

    def _launch_round(self, r: int, landed: int, send_bytes: Sequence[int], send_begin: Sequence[int],
                      stream: int) -> None:
        o = self.offsets
        self._device_rounds.rail_round(self.base + o["signal"], self.base + o["credit"], self.base + o["send"],
                                       self.base + o["recv"], self.slot_bytes, self.rank, r, landed, self.peers,
                                       [int(send_bytes[p]) for p in self.peers],
                                       [int(send_begin[p]) for p in self.peers], self.err_dev, self.timeout_s,
                                       stream)

    def _issue(self, ops: Sequence[Op], stream: int) -> None:
        n = self.n
        for op in ops:
            if op.kind == "put":
                n.putmem_signal_on_stream(op.dest, op.source, op.nbytes, op.sig_addr, op.value, n.SIGNAL_SET, op.pe,
                                          stream)
            else:
                n.signal_op_on_stream(op.sig_addr, op.value, n.SIGNAL_SET, op.pe, stream)
            self._count(op)

    def _count(self, op: Op) -> None:
        t = self.totals[op.pe]
        t[{"credit": "credits", "put": "puts", "signal": "signals"}[op.kind]] += 1
        t["bytes"] += op.nbytes

    def _wait(self, name: str, target: int, stream: int) -> None:
        stage = self.T.STAGE_NVSHMEM_CREDIT if name == "credit" else self.T.STAGE_NVSHMEM_SIGNAL
        self.T.wait_counters(self.base + self.offsets[name], self.world_size, self.rank, self.peers, target, stage,
                             self.err_dev, self.timeout_s, self.round, stream)

    # ---- statistics ----
    def transfer_totals(self) -> Dict[int, Dict[str, int]]:
        """Per peer, what this rank issued so far: credit signals, puts-with-signal, signals without data
        (zero-byte blocks), payload bytes."""
        return {p: dict(t) for p, t in self.totals.items()}

    def nic_totals(self) -> Dict[int, Dict[str, int]]:
        """Empty: there is no NIC of ours to count; NVSHMEM moves the bytes (see ``transfer_totals``)."""
        return {}

    def size_bytes(self) -> int:
        return self.region_bytes

    # close() (ExchangeRecord) is local: the symmetric block is freed at NVSHMEM's next collective allocation
    # (nvshmem_session).
