"""The internode path's row sizes and RDMA transport regions as the extension describes them (csrc/runtime/
internode_layout.hpp, exported as ``deepcomm._C.internode_rows``, ``nic_region_layout`` and
``nvshmem_region_layout``), read once per argument tuple: these offsets are shared with the kernels and with
peers, so Python never computes them."""
from __future__ import annotations

from functools import lru_cache
from types import MappingProxyType, ModuleType
from typing import Mapping

from .._ext import extension_error, load_extension


def extension() -> ModuleType:
    """``deepcomm._C``; RuntimeError when it is not built (the internode path cannot run without it)."""
    C = load_extension()
    if C is None:
        raise RuntimeError(f"deepcomm: the internode path needs the extension deepcomm._C ({extension_error()})")
    return C


@lru_cache(maxsize=None)
def rows(max_tokens: int, hidden: int) -> Mapping[str, int]:
    """``node_row``, ``rail_row`` and ``slot`` bytes (InternodeRows)."""
    return MappingProxyType(dict(extension().internode_rows(max_tokens, hidden)))


@lru_cache(maxsize=None)
def nic_region(world_size: int, slot_bytes: int) -> Mapping[str, int]:
    """Offsets of ``signal``, ``credit``, ``fa_old``, ``send``, ``recv`` and the ``total`` bytes (NicRegion)."""
    return MappingProxyType(dict(extension().nic_region_layout(world_size, slot_bytes)))


@lru_cache(maxsize=None)
def nvshmem_region(world_size: int, slot_bytes: int) -> Mapping[str, int]:
    """Offsets of ``signal``, ``credit``, ``send``, ``recv`` and the ``total`` bytes (NvshmemRegion)."""
    return MappingProxyType(dict(extension().nvshmem_region_layout(world_size, slot_bytes)))


def clear_caches() -> None:
    """Forget the layouts read so far (tests that stand in for the extension)."""
    rows.cache_clear()
    nic_region.cache_clear()
    nvshmem_region.cache_clear()
