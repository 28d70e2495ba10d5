"""Fresh-dispatch workspaces handed out again once nothing holds them, instead of a ``torch.empty`` per call (which
costs a GPU host about 2.5 µs, a tenth of a fresh dispatch's host time beyond its wait).

A workspace (deepcomm/nvlink/backend.py ``_fresh``) is one int32 tensor that the kernels fill and the dispatch's
handle keeps, read through pointers by the handle's combine and cached dispatches. When the handle and the call's
outputs are gone, only the pool refers to the tensor, and a later fresh dispatch may take it: calls on a Buffer run
in stream order one after another (CudaBackend._order), so the new call's kernels start after every earlier call's
kernels that used it. Not pooled: a workspace whose handle made a tensor view of it (``WorkspaceViews.make``: the
view may outlive the handle unseen) and workspaces of calls captured in CUDA graphs (their replays write it later),
which only waited fresh dispatches avoid by construction (they cannot be captured)."""
from __future__ import annotations

import sys
from collections import deque
from typing import Dict

import torch

SLOTS_PER_SIZE = 64   # workspaces kept per size class: a training step keeps one per MoE layer alive until backward
SIZE_CLASSES = 24     # size classes (powers of two of int32 elements) a pool keeps


class WorkSlot:
    """One pooled workspace; ``escaped`` once a tensor view of it was made (it then leaves the pool, and ``work`` is
    None: the views keep the memory as long as they need it)."""
    __slots__ = ("work", "escaped")

    def __init__(self, work: torch.Tensor):
        self.work, self.escaped = work, False


class WorkPool:
    """Workspaces by size class (int32 elements, rounded up to a power of two), oldest first."""

    def __init__(self, device: torch.device):
        self._device = device
        self._queues: Dict[int, deque] = {}

    def take(self, elements: int) -> WorkSlot:
        """A workspace of at least ``elements`` int32 elements that nothing else holds: a pooled one where the
        oldest or the next of its class is free, else a new one (kept while its class has room)."""
        size = 1 << max(elements - 1, 0).bit_length()
        q = self._queues.get(size)
        if q is None:
            if len(self._queues) >= SIZE_CLASSES:
                return WorkSlot(torch.empty(size, dtype=torch.int32, device=self._device))
            q = self._queues[size] = deque()
        for _ in range(min(2, len(q))):  # a handle kept for long stays busy at the head: look one further
            slot = q[0]
            if slot.escaped:
                q.popleft()
                continue
            q.rotate(-1)
            # held by the slot and by getrefcount's argument only: no handle, output or pending call refers to it
            if sys.getrefcount(slot.work) == 2:
                return slot
        slot = WorkSlot(torch.empty(size, dtype=torch.int32, device=self._device))
        if len(q) < SLOTS_PER_SIZE:
            q.append(slot)
        return slot

    def held(self) -> int:
        """Workspaces the pool keeps (diagnostics and tests)."""
        return sum(len(q) for q in self._queues.values())

    def clear(self) -> None:
        self._queues.clear()
