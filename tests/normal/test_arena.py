"""The dispatch-output arena's bookkeeping (deepcomm/cuda/arena.py), on CPU: ranges are taken from the free list,
a range whose launch failed goes back with release(), and freed neighbours coalesce."""
import torch

from deepcomm.cuda.arena import ALIGN, Arena


def test_reserve_release_coalesce():
    arena = Arena(0, 8 * ALIGN, torch.device("cpu"))
    a = arena.reserve(ALIGN)
    b = arena.reserve(2 * ALIGN + 1)  # rounded up to 3 * ALIGN
    assert a == (0, ALIGN) and b == (ALIGN, 3 * ALIGN)
    assert arena.free_bytes() == 4 * ALIGN
    assert arena.reserve(5 * ALIGN) is None  # full: the caller falls back to the bounce area
    arena.release(*b)
    arena.release(*a)
    assert arena.free_bytes() == 8 * ALIGN
    assert arena.reserve(8 * ALIGN) == (0, 8 * ALIGN)  # the released ranges merged back into one


def test_releases_are_counted():
    arena = Arena(0, 4 * ALIGN, torch.device("cpu"))
    got = arena.reserve(ALIGN)
    assert arena.releases == 0
    arena.release(*got)
    assert arena.releases == 1  # the CUDA backend's _order compares this with the count it last saw
