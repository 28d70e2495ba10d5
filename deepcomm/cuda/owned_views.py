"""Tensors with storages of their own over one owner's memory (deepcomm._C.OwnedViews, csrc/bindings/owned_views.cpp),
made through torch's DLPack exchange table: the torch operators (deepcomm/custom_ops.py) return a fresh dispatch's
routing tensors, which are parts of one workspace, this way instead of copying each (an operator's outputs must not
share a storage), and its per-expert counts as a host tensor without torch's per-element conversion."""
from __future__ import annotations

from typing import Optional

import torch

from .dlpack_table import DLPACK_TYPES, exchange_api

_maker = []  # [OwnedViews or None], looked up once


def owned_views():
    """deepcomm._C.OwnedViews for torch's exchange table, or None (no extension, no usable table): the callers then
    copy."""
    if not _maker:
        from .._ext import load_extension
        C, api, made = load_extension(), exchange_api(), None
        if C is not None and api is not None and hasattr(C, "OwnedViews"):
            try:
                made = C.OwnedViews(api)
            except ValueError:  # a table of another major version
                made = None
        _maker.append(made)
    return _maker[0]


def device_of(t: torch.Tensor) -> tuple:
    """``(DLPack device type, device index)`` of ``t``'s memory (the extension's codes, as the arena takes them)."""
    from .._ext import load_extension
    C = load_extension()
    return (C.DLPACK_CUDA, t.device.index) if t.device.type == "cuda" else (C.DLPACK_CPU, 0)


def absent_spec() -> tuple:
    """The spec of an empty float32 view (an absent optional output)."""
    return (0, (0,), *DLPACK_TYPES[torch.float32])


def int32_host(values) -> Optional[torch.Tensor]:
    """``values`` (a list of ints) as an int32 CPU tensor, or None without OwnedViews."""
    maker = owned_views()
    return None if maker is None else maker.int32_host(values)


def workspace_outputs(ws, names, num_absent: int) -> Optional[tuple]:
    """The views ``names`` of a handle's workspace (deepcomm/handle.py WorkspaceViews) as tensors with storages of
    their own, each keeping the workspace alive, then ``num_absent`` empty float32 tensors on its device: one
    crossing. None where OwnedViews is not there or a view is not contiguous (the caller copies instead)."""
    maker = owned_views()
    if maker is None:
        return None
    specs = []
    for name in names:
        shape, strides, offset, dtype = ws.extent(name)
        if tuple(strides) != _contiguous(shape) or dtype not in DLPACK_TYPES:
            return None
        specs.append((offset, tuple(shape), *DLPACK_TYPES[dtype]))
    specs.extend([absent_spec()] * num_absent)
    base = ws.base
    ws.escape()
    return maker.views(base, ws.base_ptr, base.numel() * base.element_size(), *device_of(base), specs)


def _contiguous(shape) -> tuple:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))
