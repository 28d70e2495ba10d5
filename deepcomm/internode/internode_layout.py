"""The internode path's row sizes, the hierarchical kernels' rows and the RDMA transport regions as the extension
describes them (csrc/runtime/internode_layout.hpp and hier_rows.hpp, exported as ``deepcomm._C.internode_rows``,
``hier_dispatch_row``, ``hier_held_row``, ``nic_region_layout`` and ``nvshmem_region_layout``), read once per
argument tuple: these offsets are shared with the kernels and with peers, so Python never computes them."""
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


@lru_cache(maxsize=None)
def dispatch_row(x_bytes: int, scale_bytes: int, topk: int, with_idx: bool, with_weights: bool,
                 gpus: int) -> Mapping[str, int]:
    """A hierarchical dispatch row (HierDispatchRow, csrc/runtime/hier_rows.hpp): ``scale_off``, ``idx_off``,
    ``src_off``, ``w_off`` (-1 for a part the row lacks), ``mask_off`` and ``stride`` bytes."""
    got = extension().hier_dispatch_row(x_bytes, scale_bytes, topk, with_idx, with_weights, gpus)
    return MappingProxyType(dict(got))


@lru_cache(maxsize=None)
def held_row(hidden: int, topk: int, fp8: bool) -> Mapping[str, int]:
    """A combine's held row (HierHeldRow): ``x_bytes``, ``w_off`` and ``stride`` bytes."""
    return MappingProxyType(dict(extension().hier_held_row(hidden, topk, fp8)))


def clear_caches() -> None:
    """Forget the layouts read so far (tests that stand in for the extension)."""
    rows.cache_clear()
    nic_region.cache_clear()
    nvshmem_region.cache_clear()
    dispatch_row.cache_clear()
    held_row.cache_clear()
