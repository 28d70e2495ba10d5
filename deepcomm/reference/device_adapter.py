"""A reference Buffer used with tensors of another device: the oracle of ranks that share a GPU.

Ranks that share one GPU bootstrap over gloo (NCCL refuses two ranks on one GPU), so their reference Buffer lives on
the CPU (docs/api.md, "Process groups and devices"), while the CUDA Buffer it checks takes CUDA tensors.
``DeviceAdapter(ref, device)`` moves every tensor argument of a call (inside tuples and handles too) to the
reference Buffer's device and every tensor of the result to ``device``, so a test or the soak writes the same
calls and comparisons on both Buffers. With both on one device it changes nothing.
"""
from __future__ import annotations

import dataclasses

import torch

from ..handle import Handle, LowLatencyHandle

_HANDLES = (Handle, LowLatencyHandle)


def move(value, device: torch.device):
    """``value`` with every tensor in it (tuples, lists, handles' fields) on ``device``; other values as they are.
    A handle moved keeps its ``buffer_id``, so the Buffer that made it still accepts it."""
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(move(v, device) for v in value)
    if isinstance(value, list):
        return [move(v, device) for v in value]
    if isinstance(value, _HANDLES):
        return dataclasses.replace(value, **{f.name: move(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value)
                                             if torch.is_tensor(getattr(value, f.name))})
    return value


class DeviceAdapter:
    """``buffer`` (a reference Buffer) called with, and answering in, tensors on ``device``. Attributes other than
    methods (``rank``, ``topology``...) are the buffer's own."""

    def __init__(self, buffer, device: torch.device):
        self.buffer, self.device = buffer, torch.device(device)

    def __getattr__(self, name):
        attr = getattr(self.buffer, name)
        if not callable(attr) or self.buffer.device == self.device:
            return attr

        def call(*args, **kwargs):
            if kwargs.get("return_recv_hook"):
                # the result would be copied before the hook fills it
                raise ValueError("return_recv_hook: not available through a DeviceAdapter (the result is copied "
                                 "to the caller's device at once)")
            here = self.buffer.device
            out = attr(*move(args, here), **{k: move(v, here) for k, v in kwargs.items()})
            return move(out, self.device)
        return call
