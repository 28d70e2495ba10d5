"""Host-side allocator for the arena of a rank's NVLink buffer.

Dispatch outputs live in the arena so that peers can store rows straight into them (zero copy). A block is
handed out as typed torch tensors (``views``) that keep a small owner object alive; when the last of them dies the
owner queues the block for release, and the next allocation takes it back. Blocks are only reused by later
dispatches, whose kernels run after everything the caller queued before them (each call waits for the caller's
stream, or runs on it), so a block is never overwritten while still read.
"""
from __future__ import annotations

import bisect
from collections import deque
from typing import Deque, List, Optional, Tuple

import torch

ALIGN = 256


class _DeviceBytes:
    """Exposes raw device memory through ``__cuda_array_interface__``; keeps ``owner`` alive as long as views."""

    def __init__(self, ptr: int, nbytes: int, owner=None):
        self._owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None, "stream": None}


def as_device_bytes(ptr: int, nbytes: int, device: torch.device, owner=None) -> torch.Tensor:
    """A uint8 tensor over raw device memory (no copy, no synchronization)."""
    return torch.as_tensor(_DeviceBytes(ptr, nbytes, owner), device=device)


class _Block:
    """Owner of one reserved arena block: gives it back when the last view holding it dies."""

    def __init__(self, arena: "Arena", offset: int, nbytes: int):
        self._arena, self.offset, self.nbytes = arena, offset, nbytes

    def __del__(self):
        self._arena._released.append((self.offset, self.nbytes))
        self._arena.releases += 1


# CUDA array interface type strings of the dtypes an output is made of; bf16 and fp8 travel as same-size ints and
# are viewed back (the interface has no such types)
_TYPESTR = {torch.int64: "<i8", torch.int32: "<i4", torch.float32: "<f4", torch.int16: "<i2", torch.uint8: "|u1"}
_AS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}


class _View:
    """One typed array over an arena block; holds the block's owner, so the block lives while any view does."""
    __slots__ = ("_owner", "__cuda_array_interface__")

    def __init__(self, owner, ptr: int, shape, typestr: str):
        self._owner = owner
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False), "version": 3,
                                         "strides": None, "stream": None}


class Arena:
    def __init__(self, base_ptr: int, nbytes: int, device: torch.device):
        self.base_ptr, self.nbytes, self.device = base_ptr, nbytes, device
        self._free: List[Tuple[int, int]] = [(0, nbytes)]  # sorted (offset, size), coalesced
        self._released: Deque[Tuple[int, int]] = deque()  # filled by _Block.__del__, drained by alloc
        self.releases = 0  # ranges given back so far (a caller compares it with the count it last saw)

    def _drain(self) -> None:
        while self._released:
            self._insert(*self._released.popleft())

    def _insert(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self._free, (offset, size))
        self._free.insert(i, (offset, size))
        # merge with the right neighbour, then the left one
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            self._free[i] = (offset, size + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]

    def reserve(self, nbytes: int) -> Optional[Tuple[int, int]]:
        """``(offset, size)`` of a free range of at least ``nbytes``, taken from the free list; ``None`` when full.
        The range belongs to the caller until it is turned into tensors with ``views()``."""
        self._drain()
        size = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        for i, (off, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, free - size)
                return off, size
        return None

    def trim(self, offset: int, size: int, used: int) -> Tuple[int, int]:
        """Keep the first ``used`` bytes (rounded up) of a reserved range and give the rest back at once (nothing
        was written there: a fresh dispatch reserves its worst case and learns its size after the launch)."""
        keep = max(ALIGN, (used + ALIGN - 1) // ALIGN * ALIGN)
        if keep < size:
            self._insert(offset + keep, size - keep)
            return offset, keep
        return offset, size

    def release(self, offset: int, size: int) -> None:
        """Give back a reserved range that never became a tensor (its launch failed)."""
        self._released.append((offset, size))
        self.releases += 1

    def views(self, offset: int, size: int, specs, owned: bool = True) -> List[torch.Tensor]:
        """Typed tensors over a reserved range, one per ``(byte offset in the range, shape, dtype)``; the range
        returns to the arena when the last of them dies (``owned=False``: a range that is not the free list's,
        such as the bounce area past the arena's end, and never returns)."""
        owner = _Block(self, offset, size) if owned else None
        base = self.base_ptr + offset
        out = []
        for off, shape, dtype in specs:
            as_dtype = _AS.get(dtype, dtype)
            t = torch.as_tensor(_View(owner, base + off, shape, _TYPESTR[as_dtype]), device=self.device)
            out.append(t if as_dtype is dtype else t.view(dtype))
        return out

    def free_bytes(self) -> int:
        self._drain()
        return sum(size for _, size in self._free)
