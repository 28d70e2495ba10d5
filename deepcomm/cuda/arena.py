"""Host-side allocator for the arena of a rank's NVLink buffer.

Dispatch outputs live in the arena so that peers can store rows straight into them (zero copy). A block is
handed out as typed torch tensors (``views``, DLPack tensors made by the C++ core in one crossing) that share an
owner; when the last of them dies the block is queued for release, and the next allocation takes it back. Blocks
are only reused by later dispatches, whose kernels run after everything the caller queued before them (each call
waits for the caller's stream, or runs on it), so a block is never overwritten while still read.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from .dlpack_table import DLPACK_TYPES, exchange_api

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


# An output's DLPack type is DLPACK_TYPES'. FP8 (DLPack's float8_e4m3fn code) is imported as such where this torch
# reads that code (Arena probes it once), else leaves as uint8 and is viewed back.
_AS_BYTES = {torch.float8_e4m3fn: torch.uint8}


def _dlpack_importer():
    """torch's importer of a DLPack capsule: its raw form where this torch has it (no protocol checks per call),
    else the public one, which takes capsules too."""
    return getattr(torch._C, "_from_dlpack", None) or torch.utils.dlpack.from_dlpack


class Arena:
    """The free list and the views of one arena (csrc/runtime/arena_core.hpp, ``deepcomm._C.ArenaCore``).
    ``reserve(nbytes)`` -> ``(offset, size)`` or None when full; ``trim(offset, size, used)`` keeps the first
    ``used`` bytes of a reserved range (a fresh dispatch reserves its worst case and learns its size after the
    launch); ``release(offset, size)`` gives back a range that never became views (its launch failed);
    ``free_bytes()``; ``releases``: ranges given back so far (the CUDA backend's _order compares it with the count
    it last saw)."""

    def __init__(self, base_ptr: int, nbytes: int, device: Optional[torch.device]):
        from .._ext import load_extension
        C = load_extension()
        if C is None:
            raise RuntimeError("deepcomm._C is not built: the arena needs it")
        on_cuda = device is not None and device.type == "cuda"
        index = (device.index if device.index is not None else torch.cuda.current_device()) if on_cuda else 0
        self.base_ptr, self.nbytes, self.device = base_ptr, nbytes, device
        # views are made through torch's DLPack exchange table where it has one (no capsule, no Python call)
        self._core = C.ArenaCore(base_ptr, nbytes, ALIGN, C.DLPACK_CUDA if on_cuda else C.DLPACK_CPU, index,
                                 _dlpack_importer(), exchange_api())
        # the core's methods themselves: no Python frame in between on the per-call path
        self.reserve, self.trim, self.release = self._core.reserve, self._core.trim, self._core.release
        self.free_bytes = self._core.free_bytes
        self._viewed = {dtype: bytes_dtype for dtype, bytes_dtype in _AS_BYTES.items() if not self._imports(dtype)}

    @property
    def core(self):
        """The C++ core (``deepcomm._C.ArenaCore``), for a call that reserves and makes views in its own crossing."""
        return self._core

    @property
    def releases(self) -> int:
        return self._core.releases

    def _imports(self, dtype: torch.dtype) -> bool:
        """Whether this torch's DLPack importer makes ``dtype`` from its code (a view over the arena's first
        bytes, never written)."""
        if self.nbytes < 1:
            return False
        try:
            (t,) = self._core.views(0, 1, False, ((0, (1,), *DLPACK_TYPES[dtype]),))
        except Exception:  # the importer refuses the code
            return False
        return t.dtype == dtype

    def dlpack_type(self, dtype: torch.dtype) -> tuple:
        """``(packed DLPack type, dtype to view into or None)`` of an output of ``dtype``: the type the core makes
        it as (code << 8 | bits, csrc/runtime/dispatch_views.hpp), and the dtype it is viewed as after, where this
        torch cannot import ``dtype`` itself."""
        viewed = self._viewed.get(dtype)
        code, bits = DLPACK_TYPES[viewed if viewed is not None else dtype]
        return code << 8 | bits, (dtype if viewed is not None else None)

    def views(self, offset: int, size: int, specs, owned: bool = True) -> List[torch.Tensor]:
        """Typed tensors over a reserved range, one per ``(byte offset in the range, shape, dtype)``, made in one
        crossing; the range returns to the arena when the last of them dies (``owned=False``: a range that is not
        the free list's, such as the bounce area past the arena's end, and never returns)."""
        made = list(self._core.views(offset, size, owned, tuple(
            (off, shape, *DLPACK_TYPES[self._viewed.get(dtype, dtype)]) for off, shape, dtype in specs)))
        for i, spec in enumerate(specs):
            if spec[2] in self._viewed:
                made[i] = made[i].view(spec[2])
        return made
