"""Normal dispatch and combine for topologies of several nodes, hierarchical: between nodes every byte is carried
by GPU-posted mlx5 RDMA-write and fetch-add WQEs (csrc/kernels/internode_exchange.hpp), only between ranks of the
same local index ("rail" peers); inside a node rows move over NVLink peer pointers (node_link.py).

Where there is no NIC (one host posing as several nodes) the WQEs are executed by the device emulated NIC, a block
of the same grid that decodes them and performs the writes over NVLink peer pointers; a ConnectX would execute
the same bytes. The routing (hier_normal.py, over the two-hop communicator of hier_comm.py) sends each token once
per remote node and forwards it inside the node; combine reduces inside the node first and sends one partial per
(token, node). Results equal the reference backend's bit for bit.

That is the "emulated" transport of the RDMA hop (NicTransport, below). ``internode_transport="nvshmem"`` carries
the same rounds, between the same rail ranks, as NVSHMEM puts with signals instead (nvshmem_transport.py); the
routing and the NVLink hop are the same either way.

Still simple rather than fast (docs/internode.md): each exchange is one kernel launch followed by a host sync that
reads the error record, and rows are packed, forwarded and unpacked by torch copies.

Low-latency mode takes another road on these topologies (internode_ll.py): the low-latency kernels over every rank,
NVSHMEM puts to the peers NVLink cannot map.
"""
from __future__ import annotations

import os
import socket
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..config import Config
from ..gpu_share import usable_sms
from ..reference import normal
from . import hier_kernels, hier_normal
from .align import round_up
from .arena import as_device_bytes
from .exchange_record import ExchangeRecord, check_round, peer_list
from .hier_comm import HierComm
from .hier_kernels import HierKernels
from .internode_ll import InternodeLowLatency, low_latency_memory_for
from .node_link import NodeLink
from .peer_memory import PeerMemory

TOPK_MAX = 32          # top-k slots a row has room for
MAX_RANKS = 32         # the key table holds 32 regions: ours and one per peer
LOG_WQEBBS = 8         # 256 WQEBBs per send queue; every WQE is signaled, so posters never wait on a later one
CHUNK_BYTES = 1 << 20  # bytes per RDMA write WQE
LKEY_BASE, RKEY_BASE = 0x1000, 0x2000


def max_node_row_bytes(hidden: int) -> int:
    """Widest row the NVLink hop carries: a dispatch row of bf16 x (FP8 values + scales are narrower), int64
    top-k ids, fp32 top-k weights, an int32 source index and an int32 node mask, padded to 16 bytes (combine
    rows, bf16 x + weights + source index, are narrower)."""
    return round_up(2 * hidden + TOPK_MAX * 12 + 8, 16)


def max_row_bytes(hidden: int) -> int:
    """Widest row an RDMA exchange carries: a dispatch row, or a combine partial of several rows (fp32 x and
    fp32 weights)."""
    return max(max_node_row_bytes(hidden), round_up(4 * hidden + TOPK_MAX * 4, 16))


def rail_slot_bytes(max_tokens: int, hidden: int) -> int:
    """Bytes of one receive slot of the RDMA hop, for either transport: a rail rank sends us at most one row per
    token of its own (dispatch: each token once per node; combine: one partial per (token, node)), each at most
    ``max_row_bytes`` (the fp32 partial is the widest), 64-byte aligned."""
    return round_up(max_tokens * max_row_bytes(hidden), 64)


def hosts_of(group) -> List[str]:
    names: List[str] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(names, socket.gethostname(), group=group)
    return names


class NicTransport(ExchangeRecord):
    """This rank's registered memory (one IPC allocation: counters, send staging, receive slots), one device
    queue pair per peer (``peers``: every other rank by default), the key table the emulated NICs translate
    through, and the exchange round counter. A round sends one block to every peer (zero bytes allowed) and none
    to other ranks; every rank makes the same rounds with the same peer relation.

    Registered memory, 64-byte aligned parts:
        signal  u64 [R]            signal[s]: rounds whose block from s has landed here
        credit  u64 [R]            credit[s]: rounds for which s has freed its receive slot for us
        fa_old  u64 [R][2]         old values returned by our fetch-adds to peer s
        send    bytes [R * slot]   our packed rows, grouped by destination
        recv    bytes [R][slot]    recv[s]: the block rank s sent us this round
    """

    def __init__(self, C, group, rank: int, world_size: int, device: torch.device, max_tokens: int, hidden: int,
                 timeout_s: float, peers: Optional[Sequence[int]] = None):
        if not 2 <= world_size <= MAX_RANKS:
            raise ValueError(f"world_size: the internode transport takes 2..{MAX_RANKS} ranks, got {world_size}")
        self.C, self.T = C, C.transport
        self.rank, self.world_size, self.device, self.timeout_s = rank, world_size, device, timeout_s
        R = world_size
        # queue pairs only to these ranks (the internode path: the same local index on other nodes)
        self.peers = peer_list(rank, R, peers)
        self.slot_bytes = rail_slot_bytes(max_tokens, hidden)
        off: Dict[str, int] = {}
        at = 0
        for name, nbytes in (("signal", 8 * R), ("credit", 8 * R), ("fa_old", 16 * R), ("send", R * self.slot_bytes),
                             ("recv", R * self.slot_bytes)):
            off[name] = at
            at = round_up(at + nbytes, 256)
        self.offsets, self.region_bytes = off, at
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
            self.nic_blocks = hier_kernels.nic_blocks_for(sms - P, P, self.T.NIC_MAX_BLOCKS)
            stream = torch.cuda.current_stream(device).cuda_stream
            for i in range(P):
                self.T.device_qp_init(self.qp_ptr(i), LOG_WQEBBS, LOG_WQEBBS, 0, stream)
            self.seq = torch.zeros(1, dtype=torch.int64, device=device)
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

    def exchange(self, send_bytes: Sequence[int], send_begin: Sequence[int]) -> None:
        """Send bytes [send_begin[d], + send_bytes[d]) of the send area to every peer d, into d's receive slot
        for us (``send_bytes[d]`` must be 0 for a rank that is not a peer); return once every peer's block for us
        has landed (synchronizes the device, then raises CommTimeoutError if a wait timed out). Collective: every
        rank calls it the same number of times."""
        self.refuse_if_broken()
        me, R = self.rank, self.world_size
        check_round(send_bytes, send_begin, me, R, self.peers, self.slot_bytes)
        self.round += 1
        rows = self.peer_rows(send_bytes, send_begin)
        with torch.cuda.device(self.device):  # the launcher uses the current device
            stream = torch.cuda.current_stream(self.device)
            table = torch.tensor(rows, dtype=torch.int64).to(self.device)
            self.seq.fill_(self.round)
            self.T.internode_exchange(table.data_ptr(), len(self.peers), self.lkey, self.round, CHUNK_BYTES,
                                      LOG_WQEBBS, LOG_WQEBBS, self.keys, self.err_dev, self.timeout_s, me,
                                      self.seq.data_ptr(), stream.cuda_stream, nic_blocks=self.nic_blocks)
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


class InternodeBackend:
    """The CUDA backend for topologies of several nodes (same interface as the other backends): normal mode
    hierarchical (this file), low-latency mode over the whole group (internode_ll.py)."""

    name = "cuda"
    x_dtypes = (torch.bfloat16,)

    def __init__(self, group, config: Config, rank: int, world_size: int, device: torch.device, C):
        self.config, self.rank, self.world_size, self.device = config, rank, world_size, device
        G = config.gpus_per_node
        rail = [r for r in range(world_size) if r % G == rank % G]  # RDMA peers: our local index on every node
        if config.internode_transport == "nvshmem":  # NVSHMEM puts and signals (nvshmem_transport.py)
            from .nvshmem_transport import NvshmemTransport as transport_cls
        else:  # "emulated": GPU-posted WQEs, the device emulated NIC
            transport_cls = NicTransport
        with torch.cuda.device(device):
            self.transport = transport_cls(C, group, rank, world_size, device, config.max_tokens_per_rank,
                                           config.hidden, config.timeout_s, peers=rail)
            try:
                self.link = NodeLink(C, group, rank, world_size, G, device,
                                     world_size * config.max_tokens_per_rank * max_node_row_bytes(config.hidden),
                                     config.timeout_s)
            except BaseException:
                self.transport.close()
                raise
        try:  # low-latency mode: its own buffer over the whole group, made at the first call (internode_ll.py)
            ll_memory = low_latency_memory_for(hosts_of(group), config.low_latency_memory)
            with torch.cuda.device(device):
                self.ll = InternodeLowLatency(C, group, config, rank, world_size, device, ll_memory)
        except BaseException:
            self.link.close()
            self.transport.close()
            raise
        self.comm = HierComm(self.transport, self.link, rank, world_size, G, device)
        # The dedicated kernels (hier_kernels.py) carry the emulated transport unless DEEPCOMM_INTERNODE_KERNELS=0;
        # the NVSHMEM transport's host-side puts keep the torch routing (hier_normal.py).
        self.kernels = None
        if transport_cls is NicTransport and os.environ.get("DEEPCOMM_INTERNODE_KERNELS", "1") != "0":
            self.kernels = HierKernels(self.comm, config.num_sms)

    def get_dispatch_layout(self, topk_idx, num_experts):
        from .. import layout
        return layout.get_dispatch_layout(topk_idx, num_experts, self.world_size)

    def _check_topk(self, k: int) -> None:
        if k > TOPK_MAX:
            raise ValueError(f"topk_idx: at most {TOPK_MAX} experts per token on the internode backend, got {k}")

    def _normal_mode_check(self) -> None:
        """Normal mode needs every rank, and a Buffer a low-latency timeout broke is done (as on one node); an
        input error of a low-latency call stays recorded for that mode."""
        self.ll.nvl.check_error(low_latency=False, leave_input=True)

    # previous_event / async_finish: every exchange synchronizes before it returns, so there is
    # nothing to overlap; accepted so code runs unchanged on every backend.
    def dispatch(self, x, topk_idx, topk_weights, num_experts, handle, expert_alignment, num_worst_tokens=0,
                 previous_event=None, async_finish=False):
        self._normal_mode_check()
        for t in (topk_idx, topk_weights):
            if t is not None:
                self._check_topk(t.shape[1])
        if handle is not None and torch.is_tensor(handle.num_recv_tokens_per_expert):
            num_worst_tokens = handle.num_recv
        with torch.cuda.device(self.device):
            if self.kernels is not None:
                out = hier_kernels.dispatch(self.kernels, x, topk_idx, topk_weights, num_experts, handle,
                                            expert_alignment)
            else:
                out = hier_normal.dispatch(self.comm, x, topk_idx, topk_weights, num_experts, handle,
                                           expert_alignment)
        return normal.pad_to_worst(out, num_worst_tokens, handle is not None) if num_worst_tokens else out

    def combine(self, x, handle, topk_weights, previous_event=None, async_finish=False, use_fp8=False):
        self._normal_mode_check()
        if topk_weights is not None:
            self._check_topk(topk_weights.shape[1])
        with torch.cuda.device(self.device):
            if self.kernels is not None:
                return hier_kernels.combine(self.kernels, x, handle, topk_weights, use_fp8)
            return hier_normal.combine(self.comm, x, handle, topk_weights, use_fp8)

    # low-latency mode (internode_ll.py)
    checks_low_latency_ids_on_device = InternodeLowLatency.checks_low_latency_ids_on_device

    def low_latency_dispatch(self, *args):
        return self.ll.low_latency_dispatch(*args)

    def low_latency_combine(self, *args, **kwargs):
        return self.ll.low_latency_combine(*args, **kwargs)

    def low_latency_buffer_info(self) -> dict:
        return self.ll.low_latency_buffer_info()

    @property
    def masked(self) -> frozenset:
        return self.ll.masked

    def mask_ranks(self, ranks: frozenset) -> None:
        self.ll.mask_ranks(ranks)

    def unmask_ranks(self) -> None:
        self.ll.unmask_ranks()

    def nic_totals(self):
        """Per peer, what the emulated NIC executed; {} with the NVSHMEM transport (no NIC of ours)."""
        return self.transport.nic_totals()

    def set_num_sms(self, num_sms: int) -> None:
        """The kernels split num_sms between the RDMA and NVLink roles (their poster and NIC blocks come on top);
        the torch routing (NVSHMEM transport) has no SM setting."""
        if self.kernels is not None:
            self.kernels.set_num_sms(num_sms)

    def size_bytes(self) -> int:
        ll = self.ll.low_latency_buffer_info()["bytes"]
        return self.transport.size_bytes() + self.link.mem.nbytes + ll

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
        self.transport.check_error()
        self.link.check_error()
        self.ll.synchronize()

    def destroy(self) -> None:
        try:
            self.ll.close()
        finally:
            try:
                self.transport.close()
            finally:
                self.link.close()
