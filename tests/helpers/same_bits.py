"""Bit-for-bit comparison of two results, shared by the CPU and GPU tests."""
from __future__ import annotations

import torch


def assert_same(a, b, what: str, names=("first", "second")) -> None:
    """``a`` and ``b`` equal bit for bit: tensors (dtype, shape and bytes), tuples or lists of them (item by item),
    None and plain values; ``names`` say which side is which in the message."""
    if a is None or b is None:
        assert a is None and b is None, f"{what}: one side is None ({names[0]}: {a is None}, {names[1]}: {b is None})"
        return
    if isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b), f"{what}: {len(a)} parts vs {b!r:.80}"
        for i, (u, v) in enumerate(zip(a, b)):
            assert_same(u, v, f"{what}[{i}]", names)
        return
    if not torch.is_tensor(a):
        assert a == b, f"{what}: {a!r} ({names[0]}) vs {b!r} ({names[1]})"
        return
    assert torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype, \
        f"{what}: {a.shape}/{a.dtype} ({names[0]}) vs {getattr(b, 'shape', b)}/{getattr(b, 'dtype', '')} ({names[1]})"
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), \
        f"{what}: values differ between {names[0]} and {names[1]}"
