"""The two hops of the internode path, as a small communicator that the routing code (hier_normal.py) calls.

Ranks ``R = N nodes x G GPUs``; rank ``r`` is GPU ``r % G`` of node ``r // G``.

- **RDMA hop** (``rail_exchange``): between nodes, and only between ranks of the same local index (one NIC per
  GPU, "rail-aligned"): each rank sends one block of bytes to the rail rank of every other node, through the
  transport's exchange round (``exchange(send_bytes, send_begin)``: zero bytes for every other rank).
- **NVLink hop** (``node_hop``): inside a node, rows are put into the node GPUs' areas through peer pointers
  (``NodeLink``), between two node barriers: the first says every GPU has finished reading what the previous
  stage put in its area, the second that every put of this stage has landed.

``traffic`` counts the bytes this rank handed to each hop, per (stage, hop, peer rank): hop ``"rdma"`` (to a
rail rank of another node), ``"nvl"`` (into another GPU of the node) or ``"local"`` (into our own area).
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Dict, Iterator, List, Optional, Sequence, Union

import torch

from ..cuda.align import round_up
from . import hier_agree
from .internode_rows import RAIL_HEADER_BYTES


class NodeHop:
    """The puts of one NVLink stage (see ``HierComm.node_hop``)."""

    def __init__(self, comm: "HierComm", stage: str):
        self.comm, self.stage = comm, stage

    def put(self, local: int, byte_offset: int, rows: torch.Tensor, index: Optional[torch.Tensor] = None) -> None:
        """Copy uint8 ``rows`` ``[n, stride]`` (or the rows ``index`` selects) into node GPU ``local``'s area at
        ``byte_offset``."""
        comm = self.comm
        if index is not None:
            rows = rows.index_select(0, index)
        rows = rows.contiguous()
        comm.link.put(local, byte_offset, rows)
        if rows.numel():
            hop = "local" if local == comm.local else "nvl"
            comm.traffic[(self.stage, hop, comm.rank_of(comm.node, local))] += rows.numel()


class HierComm:
    """Rank ``rank`` of ``world_size`` ranks, ``gpus_per_node`` per node; ``transport`` carries the RDMA hop
    (NicTransport's interface: ``slot_bytes``, ``send_view``, ``recv_view``, ``exchange``), ``link`` the NVLink
    hop (NodeLink's interface: ``area``, ``put``, ``fence``, ``synchronize``)."""

    def __init__(self, transport, link, rank: int, world_size: int, gpus_per_node: int, device: torch.device):
        if world_size % gpus_per_node:
            raise ValueError(f"gpus_per_node: {gpus_per_node} does not divide the world size {world_size}")
        self.transport, self.link = transport, link
        self.rank, self.world_size, self.device = rank, world_size, device
        self.gpus = gpus_per_node
        self.num_nodes = world_size // gpus_per_node
        self.node, self.local = divmod(rank, gpus_per_node)
        self.other_nodes = [m for m in range(self.num_nodes) if m != self.node]
        self.traffic: Counter = Counter()
        # The torch routing (hier_normal.py), where calls of every kind meet in the same exchanges: a count round's
        # rail header carries our words in our slot of our node's GPUs, and our strip is zeroed once read
        # (hier_agree.py). The kernels (hier_kernels.py) set it False: their count round only ever meets count
        # rounds (a cached dispatch or a combine is a launch with handshakes of its own), and keeps its row alone.
        self.node_headers = True
        self._empty = torch.empty(0, dtype=torch.uint8, device=self.device)  # what a rail rank sent: nothing

    # ---- topology ----
    def rank_of(self, node: int, local: int) -> int:
        return node * self.gpus + local

    def rail(self) -> List[int]:
        """The ranks with our local index, nodes ascending (us included): the ranks we forward for."""
        return [self.rank_of(m, self.local) for m in range(self.num_nodes)]

    def node_ranks(self, node: Optional[int] = None) -> List[int]:
        first = (self.node if node is None else node) * self.gpus
        return list(range(first, first + self.gpus))

    # ---- RDMA hop ----
    def rail_exchange(self, blocks: Dict[int, Sequence[torch.Tensor]], recv_bytes: Dict[int, int],
                      stage: str, header: Optional[torch.Tensor] = None, wait: bool = True) -> Dict[int, torch.Tensor]:
        """Send to the rail rank of each other node ``m`` the uint8 tensors ``blocks[m]`` (each contiguous, with
        16-byte rows), back to back; return, per other node ``m``, the ``recv_bytes[m]`` bytes its rail rank
        sent us (a view of the transport's receive slot: valid until the next exchange). Collective.
        ``header`` (uint8 ``[RAIL_HEADER_BYTES]``, a call's first exchange: hier_agree.py) goes in front of every
        block, and every rail rank's header is in front of what it sent us (``hier_agree.rail_rows``).
        ``wait=False``: the round is only queued on the current stream (the views fill in stream order); the
        caller synchronizes and reads the transport's error record."""
        hb = self._rail_round(blocks, recv_bytes, stage, header, wait)
        tr = self.transport
        return {m: tr.recv_view(self.rank_of(m, self.local), 1, hb + recv_bytes[m])[0][hb:] if recv_bytes[m]
                else self._empty for m in self.other_nodes}

    def _rail_round(self, blocks: Union[Dict[int, Sequence[torch.Tensor]], Sequence[torch.Tensor]],
                    recv_bytes: Dict[int, int], stage: str, header: Optional[torch.Tensor], wait: bool) -> int:
        """rail_exchange's round, the received blocks left in the receive slots, each after the header's bytes
        (returned: 0 without a header). ``blocks`` as a sequence: the same blocks for every other node (a count
        round), each copied into every node's section at once."""
        same = not isinstance(blocks, dict)
        if header is not None:
            blocks = ([header] + list(blocks) if same else
                      {m: [header] + list(blocks.get(m, ())) for m in self.other_nodes})
            recv_bytes = {m: header.numel() + recv_bytes[m] for m in self.other_nodes}
            self._rail_round(blocks, recv_bytes, stage, None, wait)
            return header.numel()
        tr, R = self.transport, self.world_size
        send_bytes, send_begin = [0] * R, [0] * R
        at = 0
        for m in self.other_nodes:
            d = self.rank_of(m, self.local)
            n = sum(p.numel() for p in (blocks if same else blocks.get(m, ())))
            if n > tr.slot_bytes or recv_bytes[m] > tr.slot_bytes:
                raise ValueError(f"x: a block of {max(n, recv_bytes[m])} bytes between rail ranks exceeds the "
                                 f"receive slot ({tr.slot_bytes} bytes); raise max_tokens_per_rank or hidden")
            send_begin[d], send_bytes[d] = at, n
            at += n
        if at:
            send = tr.send_view(1, at)[0]
            k = len(self.other_nodes)
            if same and k > 1:  # the sections are back to back, all alike: one expanded copy per block fills them
                sections, o = send.view(k, at // k), 0
                for piece in blocks:
                    n = piece.numel()
                    dst = sections if n == sections.shape[1] else sections[:, o:o + n]
                    dst.copy_(piece.reshape(1, n).expand(k, n))
                    o += n
            else:
                for m in self.other_nodes:
                    o = send_begin[self.rank_of(m, self.local)]
                    for piece in (blocks if same else blocks.get(m, ())):
                        send[o:o + piece.numel()].copy_(piece.reshape(-1))
                        o += piece.numel()
            for m in self.other_nodes:
                d = self.rank_of(m, self.local)
                self.traffic[(stage, "rdma", d)] += send_bytes[d]
        if wait:
            tr.exchange(send_bytes, send_begin)
        else:
            tr.exchange(send_bytes, send_begin, wait=False)
        return 0

    # ---- NVLink hop ----
    @contextlib.contextmanager
    def node_hop(self, stage: str, wait: bool = True) -> Iterator[NodeHop]:
        """``with comm.node_hop(stage) as hop: hop.put(...)``; afterwards our area holds what the node's GPUs put
        there (read it with ``node_area()`` before the next ``node_hop``). Collective over the node.
        ``wait=False``: no host sync after the second barrier (the caller synchronizes and reads the link's
        error record); what follows on the stream still runs after it."""
        self.link.fence(stage + ":free")  # every node GPU has read what the previous stage put in its area
        yield NodeHop(self, stage)
        self.link.fence(stage)            # every put of this stage has landed
        if wait:
            self.link.synchronize()       # raises CommTimeoutError if a barrier timed out

    def node_area(self) -> torch.Tensor:
        return self.link.area()

    # ---- both hops ----
    def all_gather(self, t: torch.Tensor, stage: str, wait: bool = True,
                   words: Optional[Sequence[int]] = None) -> torch.Tensor:
        """``[R, *t.shape]``: every rank's ``t``. Our row goes by RDMA to our rail ranks; then each rank puts the
        rows of its rail into every GPU of its node. ``wait=False``: both hops only queued (the result fills in
        stream order); the caller makes the one host sync and reads both error records. ``words``: the call's words,
        which the row starts with (hier_agree.py); with several GPUs per node they also travel through the strip (and
        with ``node_headers`` in our slot of a rail header first), so every rank's words land in place even where
        the ranks disagree about the row's length or the kind of call (the gathered rows then start with the
        strip's words)."""
        R, N = self.world_size, self.num_nodes
        flat = (t if t.dim() == 1 and t.is_contiguous() else t.contiguous().reshape(-1)).view(torch.uint8)
        nbytes = flat.numel()
        stride = round_up(nbytes, 16)
        if nbytes == stride:  # already whole 16-byte rows (count_row pads its row so): sent as it is
            mine = flat.view(1, stride)
        else:
            mine = torch.zeros(1, stride, dtype=torch.uint8, device=self.device)
            mine[0, :nbytes] = flat
        head = (hier_agree.first_header(self, words) if words is not None and self.gpus > 1 and self.node_headers
                else None)
        hb = self._rail_round([mine], {m: stride for m in self.other_nodes}, stage, head, wait)
        # our rail's rows, nodes ascending: every rail slot in one view (ours holds stale bytes), ours in between
        slots = self.transport.recv_rows(self.rank_of(0, self.local), self.gpus, N, hb + stride)
        if hb:
            slots = slots[:, hb:]
        rows = torch.cat([slots[:self.node], mine, slots[self.node + 1:]])
        if self.gpus > 1:
            # The node's areas hold the rows local index first (slot l * N + m, as the strip): our rail's rows are
            # one block, one put per node GPU.
            with self.node_hop(stage + ":node", wait=wait) as hop:
                for g in range(self.gpus):
                    hop.put(g, self.local * N * stride, rows)
                if words is not None:
                    hier_agree.put_rail_words(self, hop, rows)
            # rank order (m * G + l), out of our node area, which the next hop overwrites
            area = self.node_area()[:R * stride].view(self.gpus, N, stride)
            rows = area.transpose(0, 1).clone(memory_format=torch.contiguous_format).view(R, stride)
            if words is not None:
                rows[:, :RAIL_HEADER_BYTES] = hier_agree.strip_words(self)
                if self.node_headers:
                    hier_agree.clear_strip(self)
        if nbytes < stride:
            rows = rows[:, :nbytes]
        out = rows.view(t.dtype)  # [R, elements of one row]
        if not out.is_contiguous():  # rows cut from their 16-byte stride (count_row pads its row: not there)
            out = out.contiguous()
        return out if t.dim() == 1 else out.view(R, *t.shape)
