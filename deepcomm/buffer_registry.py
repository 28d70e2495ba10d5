"""Live Buffers by id: the custom ops (deepcomm/custom_ops.py) take a Buffer as its int ``buffer_id``, since an
operator's arguments are tensors and plain values. Weak: a Buffer nobody holds is gone from here too."""
from __future__ import annotations

import weakref

_live: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def register(buffer) -> None:
    _live[buffer.buffer_id] = buffer


def lookup(buffer_id: int):
    """The Buffer of ``buffer_id``; RuntimeError when it was freed (a destroyed one raises at its next call)."""
    buffer = _live.get(buffer_id)
    if buffer is None:
        raise RuntimeError(f"deepcomm: Buffer {buffer_id} no longer exists (it was freed)")
    return buffer
