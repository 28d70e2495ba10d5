"""Internode normal dispatch and combine as dedicated kernels (csrc/kernels/hier_kernels.hpp): the same routes
and the same results, bit for bit, as hier_normal.py, but each call's RDMA hop, NVLink forwarding, node
reduction and final sum run in one launch, with ``num_sms`` split between the RDMA role (packing, reducing,
summing) and the NVLink role (forwarding, gathering); the poster block and, on the emulated transport, a crew of
NIC blocks per rail peer (up to 8, as the SMs allow: csrc/transport/nic_serve_block.cuh) come on top.

Host work per call: a fresh dispatch's count round (both hops queued, then its one host wait, for the counts:
the count matrix, the node counts and the rows per expert, which reach the host through mapped memory,
mapped_words.py), the layout arithmetic from those counts (host lists) and the outputs' allocation. The kernels
build the rows from the caller's tensors and write the received rows into the outputs (csrc/runtime/
hier_rows.hpp): no torch packing or copying around the launch. Nothing waits for the launch:
its waits are bounded and report to the transport's and the link's error records, read at the next call and in
synchronize() (a timeout is then a CommTimeoutError); a cached dispatch's or a combine's call agreement is
compared from a copy of the rail headers once that copy has run (deferred_agree.py). Small tables travel through
pinned memory (host_tables.py), so no copy syncs either. Calls on another stream than the last one first wait
(on the device) for it.

Two transports: the emulated NIC (GPU-posted WQEs, deepcomm._C's kernels, NIC blocks in the grid) and NVSHMEM
device puts (``device_puts``: the same kernels from deepcomm._nvshmem_kernels, whose poster issues chunked
put-with-signal; no NIC blocks). "nvshmem-host" keeps hier_normal.py.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import List, Optional

import torch

from ..gpu_share import usable_sms
from ..handle import Handle
from ..dispatch_rows import dispatch_outputs, part_row_bytes
from .. import agreement
from . import hier_agree, hier_route
from ..cuda.align import round_up
from .deferred_agree import DeferredAgreement, write_headers
from .hier_comm import HierComm
from .hier_normal import combine_area_rows, node_masks
from .host_tables import device_table
from .internode_layout import dispatch_row, held_row
from .internode_rows import RAIL_HEADER_BYTES
from .mapped_words import MappedWords
from .nic_transport import CHUNK_BYTES, LOG_WQEBBS
from .sm_split import nic_blocks_for, split_sms


COMBINE_TABLES = 4  # combine layouts (strides) a route keeps the device tables of


@dataclasses.dataclass
class NodeRoute:
    """What a dispatch's forwarding decided, for the combine (kept in ``Handle.node_route``)."""
    route: torch.Tensor        # int32 [N, max_rows, G + 1] (hier_kernels.hpp)
    singles: torch.Tensor      # int32 [N]
    rows_from: List[int]       # rows the rail rank of each node sent us
    counts: List[List[int]]    # the count matrix, on the host
    node_counts: List[List[int]]  # the node counts [R][N], on the host (``counts`` itself with one GPU per node)
    # What later calls with this route take as it is, made once: the device tables the kernels only read (the
    # dispatch's "rdma_slot", "masks" and "first_row" for its cached dispatches, the addresses of its held slots
    # and single-held counts ("held") for the combines; under "combine", a combine's (own_begin, gather and area
    # tables) by held_stride), and the route's extents ("extents", combine) that check_fits compares.
    tables: dict = dataclasses.field(default_factory=dict)


class HierKernels:
    """Launches the hierarchical kernels over a HierComm whose transport is a NicTransport, or, with
    ``device_puts`` (the module deepcomm._nvshmem_kernels, its device state registered), an NvshmemTransport
    made with ``signals_per_round=device_puts.NVSHMEM_CHUNKS``."""

    def __init__(self, comm: HierComm, num_sms: int, device_puts=None):
        self.comm = comm
        comm.node_headers = False  # the count round meets only count rounds here (HierComm.node_headers)
        self.tr, self.link = comm.transport, comm.link
        self.device_puts = device_puts
        self._make_counters(comm.device)
        self.agreement = DeferredAgreement()  # cached dispatches' and combines' words, compared later
        self.counts = MappedWords(self.tr.C, self.tr.T, comm.device)  # a fresh dispatch's counts, to the host
        self.event: Optional[torch.cuda.Event] = None  # the end of the last call, on its stream
        self._last_stream: Optional[torch.cuda.Stream] = None
        self.peer_table = None
        if device_puts is not None:
            if getattr(self.tr, "signals_per_round", None) != device_puts.NVSHMEM_CHUNKS:
                raise ValueError("comm: NVSHMEM device puts need an NvshmemTransport with signals_per_round = "
                                 f"{device_puts.NVSHMEM_CHUNKS}")
        else:
            # The queue pairs' table (InternodePeer rows) never changes: the section for rail rank d starts at
            # d * slot_bytes and the kernels decide the bytes. Built once, not per launch.
            R, tr = comm.world_size, self.tr
            rows = tr.peer_rows([0] * R, [d * tr.slot_bytes for d in range(R)])
            self.peer_table = torch.tensor(rows, dtype=torch.int64).to(comm.device)
        self.set_num_sms(num_sms)

    @property
    def transport_name(self) -> str:
        return "emulated" if self.device_puts is None else "nvshmem"

    def set_num_sms(self, num_sms: int) -> None:
        sms = usable_sms(self.comm.device)  # this rank's share where ranks share the GPU (gpu_share.py)
        P = len(self.tr.peers)
        if self.device_puts is not None:  # the poster block only: NVSHMEM (or a real NIC) moves the bytes
            self.rdma_blocks, self.nvl_blocks = split_sms(num_sms, sms, 1)
            self.nic_blocks = 1  # unused without emulated NICs
            return
        self.rdma_blocks, self.nvl_blocks = split_sms(num_sms, sms, 1 + P)  # room for one NIC block per queue
        # every SM the roles and the poster leave goes to the NICs (all blocks stay resident)
        self.nic_blocks = nic_blocks_for(sms - self.rdma_blocks - self.nvl_blocks - 1, P, self.tr.T.NIC_MAX_BLOCKS)

    # ---- one call ----
    def check_deferred(self) -> None:
        """At the start of a call: raise CommTimeoutError if an earlier launch's wait timed out (no host sync: what
        the records hold so far); compare the words of earlier launches whose header copy has run (a disagreement
        is raised by ``end_call``, once this call made its exchange)."""
        for record in (self.tr, self.link):
            if record.broken:  # a timeout or a failed crossing before: the same refusal as every later call
                raise record.broken_error()
            record.check_error()
        self.agreement.collect()

    def begin_call(self) -> torch.cuda.Stream:
        """The call's stream (the current one), ordered after the last call when that ran on another stream."""
        stream = torch.cuda.current_stream(self.comm.device)
        if self._last_stream is not None and self._last_stream != stream:
            stream.wait_stream(self._last_stream)  # the send area, the areas and the counters are shared
        return stream

    def end_call(self, stream: torch.cuda.Stream) -> None:
        """After the call's last launch or copy: its end event; then a disagreement found so far is raised."""
        self._last_stream = stream
        self.event = torch.cuda.Event()
        self.event.record(stream)
        self.agreement.raise_pending()

    def synchronize(self) -> None:
        """After a device sync: compare every pending header copy, raise a disagreement."""
        self.agreement.collect(wait=True)
        self.agreement.raise_pending()

    def close(self) -> None:
        self.counts.close()

    def _make_counters(self, device: torch.device) -> None:
        """The launches' block-done counters: two sets of 4, used in turn; each launch zeroes the other set at entry
        for the next one (hier_roles.cuh zero_next_counters), so that no launch of its own zeroes them."""
        self.counters = torch.zeros(2, 4, dtype=torch.int32, device=device)
        self._counter_sets = (self.counters.data_ptr(), self.counters.data_ptr() + 16)
        self._counter_set = 0  # the set the next launch counts in

    # ---- one launch ----
    def _common(self, words: bool = False, header_bytes: int = RAIL_HEADER_BYTES):
        """The part every launch shares (deepcomm._C.transport.HierLaunch, checked when built); starts the
        launch's exchange round and node epoch. ``words``: the launch is a call's first exchange with several GPUs
        per node, and carries every rank's words into our strip (``words_at``, hier_agree.py)."""
        comm, tr, link = self.comm, self.tr, self.link
        tr.refuse_if_broken()
        tr.round += 1  # also the launch's number in its waits' error records (hier_launch.hpp wait_ctx)
        mine, next_set = self._counter_sets[self._counter_set], self._counter_sets[self._counter_set ^ 1]
        puts = self.device_puts is not None
        return tr.T.HierLaunch(
            num_nodes=comm.num_nodes, gpus=comm.gpus, node=comm.node, local=comm.local,
            peers=0 if puts else self.peer_table.data_ptr(), num_peers=len(tr.peers), lkey=0 if puts else tr.lkey,
            round=tr.round, chunk_bytes=CHUNK_BYTES,
            log_wqebbs=LOG_WQEBBS, log_cqes=LOG_WQEBBS, send=tr.mem.ptr + tr.offsets["send"],
            recv=tr.mem.ptr + tr.offsets["recv"], signal=tr.mem.ptr + tr.offsets["signal"],
            signal_target=tr.round * (self.device_puts.NVSHMEM_CHUNKS if puts else 1),
            credit=tr.mem.ptr + tr.offsets["credit"] if puts else 0, nvshmem_puts=puts,
            slot_bytes=tr.slot_bytes, header_bytes=header_bytes, emulate_nic=not puts, nic_blocks=self.nic_blocks,
            area=link.area_ptrs(), free_words=link.word_ptrs("free"), arrive_words=link.word_ptrs("arrive"),
            epoch=link.next_epoch(), words_at=hier_agree.strip_at(comm) if words else -1,
            counters=mine, counters_next=next_set, rdma_blocks=self.rdma_blocks,
            nvl_blocks=self.nvl_blocks, err_dev=tr.err_dev, timeout_s=tr.timeout_s)

    def words_in_strip(self, fingerprint) -> bool:
        """Whether a launch carrying ``fingerprint`` takes every rank's words to our strip (several GPUs per node):
        else the rail headers are all there is to compare (one GPU per node, where the rail is every rank)."""
        return fingerprint is not None and self.comm.gpus > 1

    def header_bytes(self, words: bool, combine: bool) -> int:
        """The header at the front of every section: one call's words; a combine with words in the strip carries
        the words of every GPU of our node (hier_kernels.hpp)."""
        return RAIL_HEADER_BYTES * (self.comm.gpus if words and combine else 1)

    def dispatch_launch(self, words: bool = False, **fields):
        """One dispatch launch's typed arguments (HierDispatchLaunch): the shared part, then ``fields``."""
        return self.tr.T.HierDispatchLaunch(common=self._common(words), **fields)

    def combine_launch(self, words: bool = False, **fields):
        """One combine launch's typed arguments (HierCombineLaunch): the shared part, then ``fields``."""
        return self.tr.T.HierCombineLaunch(common=self._common(words, self.header_bytes(words, True)), **fields)

    def _launch(self, kernel: str, launch, fingerprint=None) -> None:
        """Launch ``kernel`` ("hier_dispatch" or "hier_combine") of the transport's module with its typed
        arguments ``launch`` on the current stream; no host sync (its waits report to the error record, read at
        the next call). ``fingerprint``: the call's words, when this launch is the call's first exchange: they go
        in the header of every section, and what the rail ranks sent is compared once its copy has run
        (deferred_agree.py)."""
        comm = self.comm
        stream = torch.cuda.current_stream(comm.device)
        if fingerprint is not None:
            write_headers(self.tr, fingerprint, comm.device)
        if self.device_puts is not None:
            getattr(self.device_puts, kernel)(launch, stream.cuda_stream)
        else:
            getattr(self.tr.T, kernel)(launch, self.tr.keys, stream.cuda_stream)
        self._counter_set ^= 1  # launched: it zeroes the other set, which the next launch counts in
        if fingerprint is not None and not fingerprint[agreement.Word.REJECTED]:
            if self.words_in_strip(fingerprint):
                self.agreement.add_strip(comm, fingerprint)
            else:
                self.agreement.add(self.tr, comm.rail(), comm.rank, fingerprint)

    def reject(self, fingerprint, cached: bool) -> None:
        """A call this rank rejected, several GPUs per node (``fingerprint``'s REJECTED word set): the launch the
        peers' call makes (a cached dispatch's, or a combine's: ``fingerprint``'s op), moving no row, so its words
        reach every rank through the strip as a call's do and every peer raises naming this rank. Nothing is
        compared here (this rank raises its own error)."""
        comm, dev = self.comm, self.comm.device
        N = comm.num_nodes
        stream = self.begin_call()
        zeros = torch.zeros(max(N, comm.world_size), 3, dtype=torch.int64, device=dev)  # every table, all zeros
        none = [0] * N
        if fingerprint[agreement.Word.OP] == agreement.Op.COMBINE:
            launch = self.combine_launch(  # the held row of 8 bf16 values and no weights: 16 bytes
                words=True, held_stride=16, w_off=16, hidden=8, topk=0, fp8=False, own_x=0, own_w=0,
                own_begin=0, gather=zeros.data_ptr(), route=zeros.data_ptr(), singles=zeros.data_ptr(), max_rows=1,
                rows_from=none, area_off=zeros.data_ptr(), partial_stride=32, rdma_slot=0, held_slot=0, one_held=0,
                num_tokens=0, out_x=0, out_w=0)
            self._launch("hier_combine", launch, fingerprint)
        else:
            assert cached, "a rejected fresh dispatch joins the count round (hier_agree.join_rejected)"
            launch = self.dispatch_launch(  # a row of 16 bytes of x (and the node mask), from no token
                words=True, x=0, scales=0, topk_idx=0, topk_weights=0, x_bytes=16, scale_bytes=0, topk=0,
                with_idx=False, with_weights=False, num_tokens=0, out_x=0, out_scales=0, out_topk_idx=0,
                out_src_idx=0, out_weights=0, first_expert=0, local_experts=0, num_recv=0, masks=0, rdma_slot=0,
                rows_to=none, rows_from=none, first_row=zeros.data_ptr(), route=zeros.data_ptr(),
                singles=zeros.data_ptr(), max_rows=1)
            self._launch("hier_dispatch", launch, fingerprint)
        self._last_stream = stream
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def check_fits(self, counts: List[List[int]], ncounts: List[List[int]], slot_stride: int, area_stride: int,
                   header_bytes: int = RAIL_HEADER_BYTES, combine: bool = False,
                   tables: Optional[dict] = None) -> None:
        """The rows of a launch against the receive slots and the NVLink areas of every rank, not only ours, from
        the counts every rank has (``counts`` [R][R], ``ncounts`` [R][N]): every rank refuses the same launch
        with the same ValueError, so that none goes on to launch while another has refused (which would time out
        there). A dispatch puts sum(counts[:, d]) rows into d's area; a combine, the rows of every rail source of
        d's forwarder for every GPU of d's node (hier_kernels.hpp). ``tables``: the route's NodeRoute.tables, which
        keep the extents (route_extents) for the route's later calls."""
        key = ("extents", combine)
        extents = tables.get(key) if tables is not None else None
        if extents is None:
            extents = route_extents(self.comm, counts, ncounts, combine)
            if tables is not None:
                tables[key] = extents
        widest_rows, most_rows = extents
        widest = widest_rows * slot_stride  # the largest rail block of the call
        if widest + header_bytes > self.tr.slot_bytes:
            raise ValueError(f"x: a block of {widest} bytes between rail ranks exceeds the receive slot "
                             f"({self.tr.slot_bytes - header_bytes} bytes); raise max_tokens_per_rank or hidden")
        most = most_rows * area_stride
        if most > self.link.area_bytes:
            raise ValueError(f"x: {most} bytes of rows into one GPU's NVLink area exceed it ({self.link.area_bytes} "
                             "bytes); raise max_tokens_per_rank or hidden of the Buffer")


def route_extents(comm: HierComm, counts: List[List[int]], ncounts: List[List[int]], combine: bool) -> tuple:
    """``(widest, most)`` in rows, over every rank of a route: the largest rail block (every entry of ``ncounts``
    travels as one) and the most rows into one GPU's NVLink area (a dispatch: every source's rows for that GPU; a
    combine: the forwarder with local index l on node n gets its rail sources' rows for node n's GPUs). O(R^2)
    additions, done in C by sum/zip: HierKernels.check_fits, once per route and kind."""
    G = comm.gpus
    widest = max(map(max, ncounts), default=0)
    if combine:
        to_node = [list(map(sum, zip(*[iter(row)] * G))) for row in counts]  # [R][N]: rows for each node's GPUs
        rail = [list(map(sum, zip(*to_node[l::G]))) for l in range(G)]  # [G][N]: summed over a local index's rail
        return widest, max(map(max, rail), default=0)
    return widest, max(map(sum, zip(*counts)), default=0)


def _rdma_slots(in_node: torch.Tensor) -> torch.Tensor:
    """int32 ``[T, N]``: the row of token t in the section for node m (tokens in order), -1 where m needs none."""
    ranks = torch.cumsum(in_node, dim=0, dtype=torch.int32) - 1
    return torch.where(in_node, ranks, -1)


# ------------------------------------------------------------------------------------------------------- launch plans
def dispatch_plan(comm: HierComm, counts: List[List[int]], ncounts: List[List[int]], in_rank: torch.Tensor,
                  stride: int, tables: Optional[dict] = None, send_pos: Optional[torch.Tensor] = None,
                  route: Optional[hier_route.RouteTables] = None) -> dict:
    """The routing fields of one dispatch launch (hier_kernels.hpp HierDispatchArgs), from the count matrix
    ``counts`` [R][R], the node counts ``ncounts`` [R][N] (``counts`` itself with one GPU per node) and our
    ``in_rank`` bool [T, R]: ``rows_to`` / ``rows_from`` [N], ``first_row`` [N][G], ``max_rows``, ``rdma_slot``
    int32 [T, N] and ``masks`` int32 [T, N] (None with one GPU per node). Host lists and CPU-or-device tensors on
    ``in_rank``'s device; no launch. ``tables``: a fresh dispatch's NodeRoute.tables, whose ``rdma_slot``,
    ``masks`` and ``first_row`` table a cached dispatch of its route takes as they are (``first_row`` is then
    None). ``send_pos``: the route's send positions, which with one GPU per node are the rdma slots themselves
    (each node is one rank). ``route``: a fresh dispatch's route tables (hier_route.py), whose rdma slots and
    node masks are taken as they are."""
    rank, N, G = comm.rank, comm.num_nodes, comm.gpus
    T = in_rank.shape[0]
    node = comm.node_ranks()
    rows_to = [ncounts[rank][m] for m in range(N)]
    rows_from = [ncounts[comm.rank_of(m, comm.local)][comm.node] for m in range(N)]
    plan = dict(rows_to=rows_to, rows_from=rows_from, max_rows=max(rows_from + [1]))
    if tables:
        return dict(plan, first_row=None, rdma_slot=tables["rdma_slot"], masks=tables["masks"])
    # node GPU d's rows from rail source (m, local) start after every lower source rank's rows for d
    below = [list(itertools.accumulate((counts[q][d] for q in range(comm.world_size)), initial=0)) for d in node]
    first_row = [[below[g][comm.rank_of(m, comm.local)] for g in range(G)] for m in range(N)]
    if route is not None:
        return dict(plan, first_row=first_row, rdma_slot=route.rdma_slot, masks=route.masks)
    if G == 1 and send_pos is not None:
        return dict(plan, first_row=first_row, rdma_slot=send_pos, masks=None)
    return dict(plan, first_row=first_row, rdma_slot=_rdma_slots(in_rank.view(T, N, G).any(dim=2)),
                masks=node_masks(in_rank, N, G).contiguous() if G > 1 else None)


def combine_plan(comm: HierComm, counts: List[List[int]], held_stride: int) -> dict:
    """The routing fields of one combine launch (hier_kernels.hpp HierCombineArgs) that come from the count matrix:
    ``held`` / ``begins`` [R] (rows we hold per source and where they start), ``gather`` [R][3] and ``area_off``
    [N][G], host lists. Where each token's partials land comes from the dispatch's route on the device (its
    rdma_slot, held_slot and one_held tables). No launch."""
    rank, R, N, G = comm.rank, comm.world_size, comm.num_nodes, comm.gpus
    held = [counts[s][rank] for s in range(R)]
    begins = [sum(held[:s]) for s in range(R)]
    # the first rows of the blocks in our node's forwarders' areas, one table per forwarder (local index)
    areas = [combine_area_rows(comm, counts, g, comm.node) for g in range(G)]
    gather = [[begins[s], held[s] if s != rank else 0,
               areas[s % G][(s, rank)] * held_stride if held[s] and s != rank else 0]
              for s in range(R)]
    ours = areas[comm.local]
    area_off = [[ours[(comm.rank_of(m, comm.local), d)] * held_stride
                 if counts[comm.rank_of(m, comm.local)][d] else 0 for d in comm.node_ranks()] for m in range(N)]
    return dict(held=held, begins=begins, gather=gather, area_off=area_off)


# ---------------------------------------------------------------------------------------------------------- dispatch
def fresh_counts(k: HierKernels, topk_idx: torch.Tensor, num_experts: int, T: int, expert_alignment: int,
                 fingerprint=None):
    """The route and count round of a fresh dispatch and its one host wait: ``(route, count_matrix, node_counts,
    counts, ncounts, per_expert)``: the route's tables (hier_route.py) and the gathered matrices on the device,
    ``counts`` [R][R], ``ncounts`` [R][N] (``counts`` with one GPU per node) and our rows per local expert
    (aligned) on the host. ``fingerprint``: the call's words, in front of the counts, compared after the wait;
    expert ids outside [-1, E) on any rank (counted by the route kernel) are refused next; either way a ValueError
    on every rank, nothing launched."""
    comm = k.comm
    rank, R, N, G = comm.rank, comm.world_size, comm.num_nodes, comm.gpus
    kernels = k.tr.T if comm.device.type == "cuda" else None  # a CPU device (the tests' stand-ins): torch
    tables = hier_route.route(kernels, topk_idx, num_experts, R, G, fingerprint)
    gathered = comm.all_gather(tables.row, "dispatch:counts", wait=False, words=fingerprint)  # no sync
    width = gathered.shape[1]
    if comm.device.type == "cuda":  # the call's one host wait: the counts, through mapped memory
        flat = k.counts.fetch(gathered, k.tr.timeout_s * 1.5 + 1.0, [k.tr, k.link], rank, "dispatch:counts (host)")
    else:
        flat = gathered.reshape(-1).tolist()
    k.tr.check_error()
    k.link.check_error()
    k.agreement.collect(wait=True)  # every earlier launch has finished: compare its words (raised by end_call)
    rows = [flat[s * width:(s + 1) * width] for s in range(R)]
    p = tables.parts
    W, at_n, at_e, at_b = p["row_ranks"], p["row_nodes"], p["row_experts"], p["row_bad"]
    if fingerprint is not None:
        hier_agree.check([r[:W] for r in rows], fingerprint)
    refuse_bad_ids([r[at_b] for r in rows], rank, num_experts)
    counts = [r[W:at_n] for r in rows]
    ncounts = [r[at_n:at_e] for r in rows] if G > 1 else counts
    L = num_experts // R  # the receiver's rows per local expert: every source's tokens naming it
    per_expert = [round_up(sum(r[at_e + rank * L + e] for r in rows), expert_alignment) for e in range(L)]
    count_matrix = gathered[:, W:at_n].contiguous()
    node_counts = gathered[:, at_n:at_e].contiguous() if G > 1 else count_matrix
    return tables, count_matrix, node_counts, counts, ncounts, per_expert


def refuse_bad_ids(bad: List[int], rank: int, num_experts: int) -> None:
    """Every rank's count of expert ids outside [-1, E), from the count round: a ValueError on every rank if any
    rank had one (this rank's count named where it had them), before anything is dispatched."""
    if not any(bad):
        return
    if bad[rank]:
        raise ValueError(f"topk_idx: {bad[rank]} expert ids outside [-1, {num_experts}) (num_experts={num_experts}); "
                         "nothing was dispatched")
    ranks = [s for s, n in enumerate(bad) if n]
    raise ValueError(f"topk_idx: rank {ranks[0]} passed expert ids outside [-1, {num_experts}); nothing was "
                     "dispatched")


def _kernel_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and 16-byte aligned, as the kernels read x rows in 16-byte vectors (a copy only for a view
    that starts mid-vector)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def recv_outputs(n: int, x_parts: List[torch.Tensor], topk: int, with_idx: bool, with_weights: bool,
                 device: torch.device) -> List[torch.Tensor]:
    """The tensors a dispatch's ``n`` received rows are written into by the kernel, in the rows' part order (x, or
    the FP8 values and scales, then with ``with_idx`` the top-k ids int64 [n, K] and the source token index int32
    [n], then with ``with_weights`` the weights fp32 [n, K]): one allocation each (cheaper on the host than typed
    views of one block, at three torch calls per view)."""
    out = [torch.empty(n, *p.shape[1:], dtype=p.dtype, device=device) for p in x_parts]
    if with_idx:
        out += [torch.empty(n, topk, dtype=torch.int64, device=device),
                torch.empty(n, dtype=torch.int32, device=device)]
    if with_weights:
        out.append(torch.empty(n, topk, dtype=torch.float32, device=device))
    return out


def dispatch(k: HierKernels, x, topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
             num_experts: int, handle: Optional[Handle], expert_alignment: int, fingerprint=None):
    """Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert, handle)``.
    ``fingerprint``: the call's words, compared in its first exchange (the count round of a fresh dispatch, the
    launch of a cached one: hier_agree.py)."""
    comm = k.comm
    rank, R, N, G = comm.rank, comm.world_size, comm.num_nodes, comm.gpus
    is_pair = isinstance(x, (tuple, list))
    rows = list(x) if is_pair else [x]
    T = rows[0].shape[0]
    dev = rows[0].device
    stream = k.begin_call()

    per_expert = fresh = None
    if handle is None:
        fresh, count_matrix, node_counts, counts, ncounts, per_expert = fresh_counts(
            k, topk_idx, num_experts, T, expert_alignment, fingerprint)
        in_rank, send_pos = fresh.in_rank, fresh.send_pos
    else:
        in_rank, send_pos, count_matrix = handle.is_token_in_rank, handle.send_pos, handle.count_matrix
        node_counts = handle.node_count_matrix
        route = handle.node_route
        if node_counts is None or route is None:
            raise ValueError("handle: it has no node route; pass a handle from this Buffer's dispatch")
        counts, ncounts = route.counts, route.node_counts

    # The kernel builds each row from these (csrc/runtime/hier_rows.hpp: x, scales, ids, source index, weights).
    x_parts = [_kernel_rows(rows[0])] + [p.contiguous() for p in rows[1:]]
    ids = topk_idx.contiguous() if handle is None else None
    weights = topk_weights.contiguous() if topk_weights is not None else None
    K = ids.shape[1] if ids is not None else (weights.shape[1] if weights is not None else 0)
    x_bytes = part_row_bytes(x_parts[0])
    scale_bytes = part_row_bytes(x_parts[1]) if is_pair else 0
    row = dispatch_row(x_bytes, scale_bytes, K, ids is not None, weights is not None, G)
    stride = row["stride"]

    reuse = handle is not None  # a cached dispatch: its route's tables as the fresh dispatch made them
    tables = handle.node_route.tables if reuse else {}
    plan = dispatch_plan(comm, counts, ncounts, in_rank, stride, tables if reuse else None, send_pos=send_pos,
                         route=fresh)
    rows_to, rows_from, max_rows, masks = plan["rows_to"], plan["rows_from"], plan["max_rows"], plan["masks"]
    k.check_fits(counts, ncounts, stride, stride, tables=tables)
    n_recv = sum(counts[s][rank] for s in range(R))
    received = recv_outputs(n_recv, x_parts, K, ids is not None, weights is not None, dev)
    outs = dict(zip(("out_x", "out_scales")[:len(x_parts)], received))
    if ids is not None:
        outs.update(out_topk_idx=received[len(x_parts)], out_src_idx=received[len(x_parts) + 1])
    if weights is not None:
        outs["out_weights"] = received[-1]
    route = torch.empty(N, max_rows, G + 1, dtype=torch.int32, device=dev)
    singles = torch.empty(N, dtype=torch.int32, device=dev)
    slots = plan["rdma_slot"]
    first = tables["first_row"] if reuse else device_table(plan["first_row"], torch.int32, dev)
    agreed = fingerprint if handle is not None else None  # a fresh dispatch compared them in its count round
    with torch.cuda.device(dev):
        k._launch("hier_dispatch", k.dispatch_launch(
            words=k.words_in_strip(agreed),
            x=x_parts[0].data_ptr(), scales=x_parts[1].data_ptr() if is_pair else 0,
            topk_idx=ids.data_ptr() if ids is not None else 0,
            topk_weights=weights.data_ptr() if weights is not None else 0, x_bytes=x_bytes,
            scale_bytes=scale_bytes, topk=K, with_idx=ids is not None, with_weights=weights is not None,
            num_tokens=T, num_recv=n_recv, first_expert=rank * (num_experts // R) if ids is not None else 0,
            local_experts=num_experts // R if ids is not None else 0,
            **{f: outs[f].data_ptr() if f in outs else 0
               for f in ("out_x", "out_scales", "out_topk_idx", "out_src_idx", "out_weights")},
            masks=masks.data_ptr() if masks is not None else 0, rdma_slot=slots.data_ptr(), rows_to=rows_to,
            rows_from=rows_from, first_row=first.data_ptr(), route=route.data_ptr(), singles=singles.data_ptr(),
            max_rows=max_rows), agreed)

    out = dispatch_outputs(received, len(rows), is_pair, topk_weights is not None, handle, rank, R,
                           num_experts, T, rows[0].shape[1], in_rank, send_pos, count_matrix,
                           expert_alignment, per_expert=per_expert, ids_local=True)
    if handle is None:
        out = out[:4] + (dataclasses.replace(out[4], node_count_matrix=node_counts,
                                             node_route=NodeRoute(route, singles, rows_from, counts, ncounts,
                                                                  dict(tables, rdma_slot=slots, masks=masks,
                                                                       first_row=first,
                                                                       held=hier_route.held_pointers(fresh)))),)
    k.end_call(stream)
    return out


# ----------------------------------------------------------------------------------------------------------- combine
def combine(k: HierKernels, x: torch.Tensor, handle: Handle, topk_weights: Optional[torch.Tensor],
            use_fp8: bool = False, fingerprint=None):
    """Returns ``(combined_x, combined_topk_weights)``. ``fingerprint``: the call's words, compared in its launch
    (hier_agree.py)."""
    comm = k.comm
    rank, R = comm.rank, comm.world_size
    info = handle.node_route
    if info is None:
        raise ValueError("handle: it has no node route; pass a handle from this Buffer's dispatch")
    counts = info.counts
    dev, H, T = x.device, x.shape[1], handle.num_tokens
    stream = k.begin_call()
    real = sum(counts[s][rank] for s in range(R))  # rows we hold (x may be worst-case sized)
    # the kernel builds the held rows from these (quantized with use_fp8); cut only where x is worst-case sized
    xs = _kernel_rows(x if x.shape[0] == real else x[:real])
    w = None
    if topk_weights is not None:
        w = topk_weights if topk_weights.shape[0] == real else topk_weights[:real]
        w = w.to(torch.float32).contiguous()
    K = w.shape[1] if w is not None else 0
    held = held_row(H, K, bool(use_fp8))
    held_stride, w_off = held["stride"], held["w_off"]
    partial_stride = round_up(4 * H + 4 * K, 16)
    combines = info.tables.setdefault("combine", {})
    made = combines.get(held_stride)  # a second combine of this route (backward): as made
    if made is None:
        plan = combine_plan(comm, counts, held_stride)
        gather, area_off = plan["gather"], plan["area_off"]
        # area_off [N][G] right after gather [R][3]: one copy to the device
        table = device_table([v for row in gather for v in row] + [v for row in area_off for v in row],
                             torch.int64, dev)
        made = (plan["begins"][rank], table)
        if len(combines) < COMBINE_TABLES:
            combines[held_stride] = made
    own_begin, table = made
    held_slot, one_held = info.tables["held"]  # the route's device addresses (hier_route.held_pointers)
    words = k.words_in_strip(fingerprint)
    k.check_fits(counts, info.node_counts, max(held_stride, partial_stride), held_stride,
                 k.header_bytes(words, True), combine=True, tables=info.tables)

    out_x = torch.empty(T, H, dtype=x.dtype, device=dev)
    out_w = torch.empty(T, K, dtype=torch.float32, device=dev) if w is not None else None
    gather_ptr = table.data_ptr()
    area_ptr = gather_ptr + 8 * 3 * R
    with torch.cuda.device(dev):
        k._launch("hier_combine", k.combine_launch(
            words=words, held_stride=held_stride, w_off=w_off, hidden=H, topk=K, fp8=bool(use_fp8),
            own_x=xs.data_ptr(), own_w=w.data_ptr() if w is not None else 0, own_begin=own_begin,
            gather=gather_ptr, route=info.route.data_ptr(), singles=info.singles.data_ptr(),
            max_rows=info.route.shape[1], rows_from=info.rows_from, area_off=area_ptr,
            partial_stride=partial_stride, rdma_slot=info.tables["rdma_slot"].data_ptr(), held_slot=held_slot,
            one_held=one_held, num_tokens=T, out_x=out_x.data_ptr(),
            out_w=out_w.data_ptr() if out_w is not None else 0), fingerprint)
    k.end_call(stream)
    return out_x, out_w
