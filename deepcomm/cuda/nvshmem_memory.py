"""One symmetric allocation per rank on NVSHMEM's heap, with every peer's copy mapped here: the same interface as
PeerMemory (deepcomm/cuda/peer_memory.py), so the low-latency buffer can live on either with no kernel change."""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from . import nvshmem_session
from .arena import as_device_bytes


class NvshmemMemory:
    """``ptr``: our block (zero-filled); ``peer_ptrs[r]``: rank r's block as mapped here (``nvshmem_ptr``; ours
    at ``rank``), or None with ``map_peers=False`` (for users that reach peers through NVSHMEM's own puts, which
    need no load/store mapping; with ``allow_unreachable`` a peer NVSHMEM cannot map is 0 there). Collective:
    every rank of the group constructs it with the same size, at the
    same time. The first one in a process initializes NVSHMEM over the group (see nvshmem_session)."""

    def __init__(self, C, group, rank: int, world_size: int, nbytes: int, map_peers: bool = True,
                 allow_unreachable: bool = False):
        self.rank, self.nbytes = rank, nbytes
        self.block, self.ptr = nvshmem_session.allocate(group, nbytes)
        try:
            self.peer_ptrs: Optional[List[int]] = (
                nvshmem_session.peer_ptrs(self.ptr, world_size, allow_unreachable) if map_peers else None)
            device = torch.device("cuda", torch.cuda.current_device())
            view = as_device_bytes(self.ptr, nbytes, device)
            if view.data_ptr() != self.ptr:  # torch placed the pointer on another device and copied it
                raise RuntimeError(f"deepcomm: torch does not see NVSHMEM's symmetric memory as memory of {device}")
            view.zero_()  # flags and sequence numbers start at 0
            torch.cuda.synchronize(device)
        except BaseException:
            nvshmem_session.release(self.block)
            raise
        dist.barrier(group=group)  # nobody launches a kernel before every peer's block is zeroed

    def close(self) -> None:
        """Local (safe from ``__del__`` on one rank): the block is freed at a later collective point."""
        nvshmem_session.release(self.block)
