"""Routing state that dispatch returns and combine (or a cached re-dispatch) reuses."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Union

import torch


class WorkspaceViews:
    """Handle tensors not made yet: named strided views of one workspace tensor, each made when its field is first
    read. A fresh dispatch of the CUDA backend returns its routing tensors this way, one object in the four fields
    (each view costs microseconds of host time per call, and most handles only go back to combine or a cached
    dispatch, which need pointers). ``specs``: field name -> ``(shape, strides, offset, dtype)``, offset and
    strides in elements of ``dtype`` (the base's when None), a shape of None meaning ``(n,)``; one mapping serves
    every call of a workspace layout. ``slot``: the pool slot the base came from (deepcomm/cuda/work_pool.py), which
    a view made of it takes out of the pool."""
    __slots__ = ("base", "base_ptr", "specs", "n", "slot")

    def __init__(self, base: torch.Tensor, specs: dict, n: int = 0, base_ptr: Optional[int] = None, slot=None):
        self.base, self.specs, self.n, self.slot = base, specs, n, slot
        self.base_ptr = base.data_ptr() if base_ptr is None else base_ptr

    def data_ptr(self, name: str) -> int:
        _, _, offset, dtype = self.specs[name]
        return self.base_ptr + offset * (self.base.element_size() if dtype is None else dtype.itemsize)

    def make(self, name: str) -> torch.Tensor:
        shape, strides, offset, dtype = self.specs[name]
        self.escape()
        base = self.base if dtype is None else self.base.view(dtype)
        return base.as_strided((self.n,) if shape is None else shape, strides, offset)

    def escape(self) -> None:
        """A view of the base is about to exist, and may outlive the handle unseen: the workspace is never reused,
        and the pool no longer keeps its memory alive."""
        if self.slot is not None:
            self.slot.escaped, self.slot.work = True, None

    def extent(self, name: str) -> tuple:
        """``(shape, strides, byte offset, dtype)`` of view ``name``."""
        shape, strides, offset, dtype = self.specs[name]
        dtype = self.base.dtype if dtype is None else dtype
        return (self.n,) if shape is None else shape, strides, offset * dtype.itemsize, dtype


class _MadeOnRead:
    """A Handle field that may hold WorkspaceViews: it becomes its tensor on first read and stays one."""

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj, objtype=None):
        if obj is None:  # looked up on the class: the field has no default
            raise AttributeError(self.name)
        value = obj.__dict__[self.slot]
        if type(value) is WorkspaceViews:
            value = obj.__dict__[self.slot] = value.make(self.name)
        return value

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = value


def field_ptr(handle, name: str) -> int:
    """The device address of ``handle``'s tensor field ``name`` without making a view that is not made yet."""
    value = handle.__dict__.get("_" + name)
    if type(value) is WorkspaceViews:
        return value.data_ptr(name)
    if value is None:
        value = getattr(handle, name)
    return value.data_ptr()


@dataclass
class Handle:
    """Route of one normal-mode dispatch (see docs/api.md, "Handle").

    Row of token ``t`` of rank ``s`` at rank ``d`` = ``sum(count_matrix[:s, d]) + send_pos_s[t, d]``.
    """

    buffer_id: int
    num_experts: int
    num_tokens: int                       # T: tokens this rank dispatched
    hidden: int                           # H of the dispatched x
    num_recv: int                         # N: rows this rank received (num_worst_tokens when that was given)
    is_token_in_rank: torch.Tensor = _MadeOnRead()   # bool  [T, R]
    send_pos: torch.Tensor = _MadeOnRead()           # int32 [T, R], -1 where not sent
    count_matrix: torch.Tensor = _MadeOnRead()       # int32 [R, R], [s, d] = tokens s sends to d
    recv_src_idx: torch.Tensor = _MadeOnRead()       # int32 [N], source token index of each received row
    # length L, aligned as requested at dispatch; an int32 device tensor for a num_worst_tokens dispatch
    num_recv_tokens_per_expert: Union[List[int], torch.Tensor]
    # int32 [R, nodes], [s, m] = tokens rank s sends to node m (a token counts once per node): set by the
    # hierarchical internode backend, whose cached dispatch needs it (docs/internode.md); None elsewhere
    node_count_matrix: Optional[torch.Tensor] = None
    # what the internode kernels' forwarding decided (deepcomm/internode/hier_kernels.py NodeRoute), for their
    # combine; None elsewhere
    node_route: Optional[object] = None
    # which call on its Buffer made it (the dispatch's number; deepcomm/agreement.py, word HANDLE): 0 until set
    call: int = 0
    # num_recv_tokens_per_expert as the int32 CPU tensor the dispatch operator returned (deepcomm.ops inside a
    # compiled graph, where the list holds symbolic ints): the operators take it back as it is instead of a tensor
    # rebuilt from the ints; None elsewhere
    per_expert_tensor: Optional[torch.Tensor] = None

    @classmethod
    def of_fresh_dispatch(cls, num_experts: int, num_tokens: int, hidden: int, num_recv: int,
                          route: WorkspaceViews, num_recv_tokens_per_expert) -> "Handle":
        """The handle a fresh dispatch returns (buffer_id -1 until its Buffer sets it), its four routing tensors
        the views ``route`` names after them, made without the generated __init__: one dict of every field's
        storage, where that __init__ costs microseconds per dispatch (a setattr per field, through _MadeOnRead for
        four of them). tests/api/test_handle_views.py checks that it stores exactly what __init__ does."""
        h = cls.__new__(cls)
        h.__dict__.update({
            "buffer_id": -1, "num_experts": num_experts, "num_tokens": num_tokens, "hidden": hidden,
            "num_recv": num_recv, "_is_token_in_rank": route, "_send_pos": route,
            "_count_matrix": route, "_recv_src_idx": route,
            "num_recv_tokens_per_expert": num_recv_tokens_per_expert, "node_count_matrix": None, "node_route": None,
            "call": 0, "per_expert_tensor": None})
        return h


@dataclass
class LowLatencyHandle:
    """Route of one low-latency dispatch (see docs/api.md, "Low-latency mode")."""

    src_info: torch.Tensor                # int32 [L, R*M], source token index of each entry, -1 past the count
    layout: torch.Tensor                  # int32 [L, R, 2], (begin, count) of each source rank's entries
    recv_pos: torch.Tensor                # int32 [T, K], row of slot k of token t at its expert, -1 for -1 slots
    num_experts: int
    num_max_dispatch_tokens_per_rank: int  # M
    hidden: int
    buffer_id: int
    # which half of the double-buffered receive area (CUDA backend); a 0-d int32 CPU tensor in a handle that
    # deepcomm.ops.low_latency_dispatch made inside a torch.compile graph
    slot: Union[int, torch.Tensor] = 0
    call: int = 0                          # the number of the dispatch that made it on its Buffer (0 until set)
