"""One device allocation per rank, mapped into every rank of the group through CUDA IPC handles."""
from __future__ import annotations

from typing import List

import torch.distributed as dist


class PeerMemory:
    """``ptr``: our allocation (zero-filled); ``peer_ptrs[r]``: rank r's allocation as mapped here (ours at
    ``rank``). Collective: every rank of the group constructs it with the same size, at the same time."""

    def __init__(self, C, group, rank: int, world_size: int, nbytes: int):
        self.C, self.rank, self.nbytes = C, rank, nbytes
        self.ptr, handle = C.ipc_alloc(nbytes)
        handles: List[bytes] = [None] * world_size  # type: ignore[list-item]
        dist.all_gather_object(handles, handle, group=group)
        self.peer_ptrs = [self.ptr if r == rank else C.ipc_open(handles[r]) for r in range(world_size)]
        dist.barrier(group=group)  # nobody launches a kernel before every peer has mapped every buffer

    def close(self) -> None:
        for r, p in enumerate(self.peer_ptrs):
            if r != self.rank:
                self.C.ipc_close(p)
        self.C.device_free(self.ptr)
