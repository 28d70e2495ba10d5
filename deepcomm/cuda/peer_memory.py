"""One device allocation per rank, mapped into every rank of the group through CUDA IPC handles."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch.distributed as dist


class PeerMemory:
    """``ptr``: our allocation (zero-filled); ``peer_ptrs[r]``: rank r's allocation as mapped here (ours at
    ``rank``; 0 for a rank outside ``peers``). Collective: every rank of the group constructs it with the same
    size, at the same time. ``peers``: the ranks to map (default all; the internode NVLink hop maps only the ranks
    of its node)."""

    def __init__(self, C, group, rank: int, world_size: int, nbytes: int, peers: Optional[Sequence[int]] = None):
        self.C, self.rank, self.nbytes = C, rank, nbytes
        self.ptr, handle = C.ipc_alloc(nbytes)
        self.peer_ptrs: List[int] = []
        mapped = set(range(world_size) if peers is None else peers)
        try:
            handles: List[bytes] = [None] * world_size  # type: ignore[list-item]
            dist.all_gather_object(handles, handle, group=group)
            for r in range(world_size):
                self.peer_ptrs.append(self.ptr if r == rank else C.ipc_open(handles[r]) if r in mapped else 0)
            dist.barrier(group=group)  # nobody launches a kernel before every peer has mapped every buffer
        except BaseException:
            self.close()  # a failed exchange or mapping must not leak our allocation or the mappings made so far
            raise

    def close(self) -> None:
        """Unmap every peer and free our allocation; every step is tried even if an earlier one fails."""
        errors = []
        for r, p in enumerate(self.peer_ptrs):
            if r != self.rank and p:
                try:
                    self.C.ipc_close(p)
                except RuntimeError as e:
                    errors.append(e)
        self.peer_ptrs = []
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            self.C.device_free(ptr)
        if errors:
            raise errors[0]
