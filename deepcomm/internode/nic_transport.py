"""The "emulated" transport of the internode RDMA hop: GPU-posted mlx5 RDMA-write and fetch-add WQEs
(csrc/kernels/internode_exchange.hpp) between rail ranks, executed where there is no NIC by the device emulated
NIC, a block of the same grid that decodes them and performs the writes over NVLink peer pointers.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..gpu_share import usable_sms
from ..cuda.align import round_up
from ..cuda.arena import as_device_bytes
from .exchange_record import ExchangeRecord, check_round, peer_list
from .host_tables import device_table
from .internode_layout import nic_region
from .internode_rows import rail_slot_bytes
from ..cuda.peer_memory import PeerMemory
from .sm_split import nic_blocks_for

LOG_WQEBBS = 8         # 256 WQEBBs per send queue; every WQE is signaled, so posters never wait on a later one
CHUNK_BYTES = 1 << 20  # bytes per RDMA write WQE
LKEY_BASE, RKEY_BASE = 0x1000, 0x2000


def region_layout(world_size: int, slot_bytes: int) -> Tuple[Dict[str, int], int]:
    """Offsets of ``signal``, ``credit``, ``fa_old``, ``send`` and ``recv`` in a rank's registered memory, and its
    size (the extension's NicRegion). ValueError for ``world_size`` outside 1..INTERNODE_MAX_RANKS or a
    ``slot_bytes`` not a multiple of 16."""
    lay = nic_region(world_size, slot_bytes)
    return {name: lay[name] for name in ("signal", "credit", "fa_old", "send", "recv")}, lay["total"]


class NicTransport(ExchangeRecord):
    """This rank's registered memory (one IPC allocation: counters, send staging, receive slots), one device
    queue pair per peer (``peers``: every other rank by default), the key table the emulated NICs translate
    through, and the exchange round counter. A round sends one block to every peer (zero bytes allowed) and none
    to other ranks; every rank makes the same rounds with the same peer relation.

    Registered memory, 256-byte aligned parts (NicRegion, csrc/runtime/internode_layout.hpp):
        signal  u64 [R]            signal[s]: rounds whose block from s has landed here
        credit  u64 [R]            credit[s]: rounds for which s has freed its receive slot for us
        fa_old  u64 [R][2]         old values returned by our fetch-adds to peer s
        send    bytes [R * slot]   our packed rows, grouped by destination
        recv    bytes [R][slot]    recv[s]: the block rank s sent us this round
    """

    def __init__(self, C, group, rank: int, world_size: int, device: torch.device, max_tokens: int, hidden: int,
                 timeout_s: float, peers: Optional[Sequence[int]] = None):
        T = C.transport
        if not 2 <= world_size <= T.INTERNODE_MAX_RANKS:
            raise ValueError(f"world_size: the internode transport takes 2..{T.INTERNODE_MAX_RANKS} ranks, "
                             f"got {world_size}")
        self.C, self.T = C, T
        self.rank, self.world_size, self.device, self.timeout_s = rank, world_size, device, timeout_s
        R = world_size
        # queue pairs only to these ranks (the internode path: the same local index on other nodes)
        self.peers = peer_list(rank, R, peers)
        if len(self.peers) + 1 > T.KEY_TABLE_REGIONS:  # the key table: our region and one per peer
            raise ValueError(f"peers: the emulated NIC's key table holds {T.KEY_TABLE_REGIONS} regions (ours and one "
                             f"per peer), got {len(self.peers)} peers")
        self.slot_bytes = rail_slot_bytes(max_tokens, hidden)
        self.offsets, self.region_bytes = region_layout(R, self.slot_bytes)
        at = self.region_bytes
        self.mem = PeerMemory(C, group, rank, world_size, at, peers=self.peers)  # the emulated NIC writes to peers
        self.err_host = 0
        try:
            self.region = as_device_bytes(self.mem.ptr, at, device, owner=self.mem)
            bases: List[int] = [None] * R  # type: ignore[list-item]
            dist.all_gather_object(bases, self.mem.ptr, group=group)  # what WQEs name: each owner's own address
            self.bases = bases
            self.lkey = LKEY_BASE + rank
            self.keys = self.T.KeyTable()
            self.keys.add(self.lkey, self.mem.ptr, at, self.mem.ptr)
            for p in self.peers:
                self.keys.add(RKEY_BASE + p, bases[p], at, self.mem.peer_ptrs[p])  # the peer "node", over NVLink

            # queue pairs, then per queue a u32 stop word (64 B), NicTotals (64 B) and the NicCrew its NIC blocks
            # share (csrc/transport/device_qp_layout.hpp), all zeroed once
            self.qp_layout = self.T.device_qp_layout(LOG_WQEBBS, LOG_WQEBBS)
            self.qp_bytes = round_up(self.qp_layout["total"], 256)
            self.aux_bytes = 128 + self.T.NIC_CREW_BYTES
            P = len(self.peers)
            self.qp_mem = torch.zeros(P * self.qp_bytes + P * self.aux_bytes, dtype=torch.uint8, device=device)
            # The exchange kernel's NIC blocks per queue: every SM beside the P posters, shared by the queues.
            sms = usable_sms(device)  # this rank's share where ranks share the GPU
            self.nic_blocks = nic_blocks_for(sms - P, P, self.T.NIC_MAX_BLOCKS)
            stream = torch.cuda.current_stream(device).cuda_stream
            for i in range(P):
                self.T.device_qp_init(self.qp_ptr(i), LOG_WQEBBS, LOG_WQEBBS, 0, stream)
            self.err_host, self.err_dev = C.host_mapped_alloc(C.error_record_bytes())
            C.clear_error(self.err_host)
            self.round = 0
            self.broken = False
            torch.cuda.synchronize(device)
            dist.barrier(group=group)  # every queue pair and region is initialised before any peer writes to us
        except BaseException:
            self.close()  # a failed set-up must not leak the registered memory or the error record
            raise

    # ---- addresses ----
    def qp_ptr(self, i: int) -> int:
        return self.qp_mem.data_ptr() + i * self.qp_bytes

    def _aux_ptr(self, i: int) -> int:
        return self.qp_mem.data_ptr() + len(self.peers) * self.qp_bytes + i * self.aux_bytes

    # ---- one round ----
    def peer_rows(self, send_bytes: Sequence[int], send_begin: Sequence[int]) -> List[List[int]]:
        """One InternodePeer row (csrc/kernels/internode_exchange.hpp) per peer, peers ascending: our block for d
        at ``send_begin[d]`` of the send area, ``send_bytes[d]`` long, into d's receive slot for us."""
        me, R = self.rank, self.world_size
        rows = []
        for i, d in enumerate(self.peers):
            peer_base = self.bases[d]
            rows.append([
                d, self.qp_ptr(i), 0x100 + me * R + d,
                self.mem.ptr + self.offsets["send"] + send_begin[d], send_bytes[d],
                peer_base + self.offsets["recv"] + me * self.slot_bytes,
                peer_base + self.offsets["signal"] + 8 * me,
                peer_base + self.offsets["credit"] + 8 * me,
                RKEY_BASE + d,
                self.mem.ptr + self.offsets["fa_old"] + 16 * d,
                self.mem.ptr + self.offsets["signal"] + 8 * d,
                self.mem.ptr + self.offsets["credit"] + 8 * d,
                self._aux_ptr(i), self._aux_ptr(i) + 64, self._aux_ptr(i) + 128,
            ])
        assert len(rows[0]) == self.T.INTERNODE_PEER_FIELDS
        return rows

    def exchange(self, send_bytes: Sequence[int], send_begin: Sequence[int], wait: bool = True) -> None:
        """Send bytes [send_begin[d], + send_bytes[d]) of the send area to every peer d, into d's receive slot
        for us (``send_bytes[d]`` must be 0 for a rank that is not a peer); return once every peer's block for us
        has landed (synchronizes the device, then raises CommTimeoutError if a wait timed out). ``wait=False``:
        return once the round is queued on the current stream; the caller synchronizes and calls
        ``check_error()`` (the kernel's waits are bounded either way). Collective: every rank calls it the same
        number of times."""
        self.refuse_if_broken()
        me, R = self.rank, self.world_size
        check_round(send_bytes, send_begin, me, R, self.peers, self.slot_bytes)
        self.round += 1
        rows = self.peer_rows(send_bytes, send_begin)
        with torch.cuda.device(self.device):  # the launcher uses the current device
            stream = torch.cuda.current_stream(self.device)
            table = device_table(rows, torch.int64, self.device)  # no host sync (host_tables.py)
            self.T.internode_exchange(table.data_ptr(), len(self.peers), self.lkey, self.round, CHUNK_BYTES,
                                      LOG_WQEBBS, LOG_WQEBBS, self.keys, self.err_dev, self.timeout_s, me,
                                      stream.cuda_stream, nic_blocks=self.nic_blocks)
            if not wait:
                return
            stream.synchronize()
        self.check_error()

    # ---- statistics ----
    def nic_totals(self) -> Dict[int, Dict[str, int]]:
        """Per peer: what our NIC for that queue pair executed so far (wqes, bytes, writes, atomics)."""
        names = self.T.NIC_TOTALS_FIELDS
        out = {}
        for i, d in enumerate(self.peers):
            o = len(self.peers) * self.qp_bytes + i * self.aux_bytes + 64
            vals = self.qp_mem[o:o + 8 * len(names)].view(torch.int64).tolist()
            out[d] = dict(zip(names, vals))
        return out

    def nic_stats(self) -> Dict[int, Dict[str, int]]:
        """Per peer: the queue's NIC record (consumer index, WQEs, CQEs, error syndrome) and poster counters."""
        out = {}
        for i, d in enumerate(self.peers):
            base = i * self.qp_bytes
            def fields(part):
                names = self.qp_layout[part + "_fields"]
                o = base + self.qp_layout[part]
                return dict(zip(names, self.qp_mem[o:o + 4 * len(names)].view(torch.int32).tolist()))
            out[d] = {"nic": fields("nic"), "poster": fields("poster")}
        return out

    def size_bytes(self) -> int:
        return self.region_bytes + self.qp_mem.numel()
