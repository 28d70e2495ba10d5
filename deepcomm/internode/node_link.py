"""The NVLink hop of the internode path: memory the GPUs of one node write into through peer pointers, and a
barrier among them (csrc/kernels/node_barrier.hpp) with bounded waits.

Each rank allocates one IPC region and maps only the regions of its own node's ranks (on a cluster the other
nodes are not reachable over NVLink):

    flags  u64 [G]          flags[i]: the last barrier epoch node GPU i announced to us (written by GPU i)
    free   u64 [G]          free[i]: the last epoch node GPU i freed its area (the hierarchical kernels,
    arrive u64 [G]          arrive[i]: ... finished writing into ours; csrc/kernels/hier_kernels.hpp)
    area   bytes [area]     rows the node's GPUs put here during one NVLink stage (see hier_comm.NodeHop)

The offsets are NodeLinkRegion's (csrc/runtime/internode_layout.hpp, ``deepcomm._C.node_link_layout``).

``put`` copies rows into a node GPU's area on the current stream (``cudaMemcpyAsync`` to the peer pointer: peer
memory never becomes a torch tensor, whose device torch would infer from the pointer); ``fence`` launches the
barrier on the same stream, so every put queued before it has landed in every node GPU before any of them runs
what it queues after its own ``fence``. Our own area is a torch tensor (``area()``).
"""
from __future__ import annotations

from typing import List

import torch

from ..cuda.arena import as_device_bytes
from .exchange_record import RecordedWaits
from ..cuda.peer_memory import PeerMemory



class NodeLink(RecordedWaits):
    """This rank's NVLink-hop memory, its node peers' memory as mapped here, and the node barrier.

    ``gpus``: GPUs per node (G); ``local``: our index in the node; ``area_bytes``: bytes of each area.
    Collective over the whole group at construction (the IPC handles travel with it)."""

    def __init__(self, C, group, rank: int, world_size: int, gpus_per_node: int, device: torch.device,
                 area_bytes: int, timeout_s: float):
        G = gpus_per_node
        if not 1 <= G <= C.transport.MAX_NODE_GPUS or world_size % G:
            raise ValueError(f"gpus_per_node: {G} must divide the world size {world_size} and be at most "
                             f"{C.transport.MAX_NODE_GPUS}")
        self.C, self.device, self.timeout_s = C, device, timeout_s
        self.gpus, self.local, self.first_rank = G, rank % G, rank - rank % G
        self.layout = C.node_link_layout(G, area_bytes)
        self.flags_bytes, self.area_bytes = self.layout["area"], self.layout["area_bytes"]  # area after the words
        self.mem = PeerMemory(C, group, rank, world_size, self.layout["total"],
                              peers=range(self.first_rank, self.first_rank + G))
        self.err_host = 0
        try:
            self._bases: List[int] = [self.mem.peer_ptrs[self.first_rank + i] for i in range(G)]
            self._flags: List[int] = [b + self.layout["flags"] for b in self._bases]  # the barrier's words
            self.region = as_device_bytes(self.mem.ptr + self.flags_bytes, self.area_bytes, device, owner=self.mem)
            self.err_host, self.err_dev = C.host_mapped_alloc(C.error_record_bytes())
            C.clear_error(self.err_host)
        except BaseException:
            self.close()
            raise
        self.epoch = 0
        self.stage = ""
        self.broken = False

    def area_ptrs(self) -> List[int]:
        """Every node GPU's area as mapped here (ours at ``local``)."""
        return [b + self.flags_bytes for b in self._bases]

    def word_ptrs(self, name: str) -> List[int]:
        """Every node GPU's ``free`` or ``arrive`` array as mapped here (ours at ``local``)."""
        if name not in ("free", "arrive"):
            raise KeyError(name)
        return [b + self.layout[name] for b in self._bases]

    def next_epoch(self) -> int:
        """The epoch of the next hierarchical kernel launch (the same sequence as the barrier's)."""
        if self.broken:
            raise self.broken_error()
        self.epoch += 1
        return self.epoch

    def area(self) -> torch.Tensor:
        """Our area, uint8 ``[area_bytes]``."""
        return self.region

    def put(self, local: int, byte_offset: int, rows: torch.Tensor) -> None:
        """Copy the contiguous uint8 tensor ``rows`` (on our device) into node GPU ``local``'s area at
        ``byte_offset``, on the current stream."""
        nbytes = rows.numel()
        if byte_offset < 0 or byte_offset + nbytes > self.area_bytes:
            raise ValueError(f"x: {byte_offset + nbytes} bytes exceed the NVLink area ({self.area_bytes} bytes); "
                             "raise max_tokens_per_rank or hidden of the Buffer")
        if nbytes == 0:
            return
        if local == self.local:
            self.region[byte_offset:byte_offset + nbytes].copy_(rows.reshape(-1))
            return
        stream = torch.cuda.current_stream(self.device)
        self.C.copy_bytes(self._bases[local] + self.flags_bytes + byte_offset, rows.data_ptr(), nbytes,
                          stream.cuda_stream)

    def fence(self, stage: str) -> None:
        """Barrier among the node's GPUs, queued on the current stream (nothing to do for one GPU per node)."""
        if self.gpus == 1:
            return
        if self.broken:
            raise self.broken_error()
        self.epoch += 1
        self.stage = stage
        stream = torch.cuda.current_stream(self.device)
        self.C.transport.node_barrier(self.mem.ptr + self.layout["flags"], self._flags, self.local, self.first_rank,
                                      self.epoch, self.err_dev, self.timeout_s, stream.cuda_stream)

    def synchronize(self) -> None:
        """Wait for the current stream, then raise CommTimeoutError if a barrier timed out (nothing to wait for
        with one GPU per node: no barrier ever ran)."""
        if self.gpus == 1:
            return
        torch.cuda.current_stream(self.device).synchronize()
        self.check_error()

    def _what(self, seq: int) -> str:
        return f"{self.stage}, node barrier #{seq}"
