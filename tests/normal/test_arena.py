"""The dispatch-output arena (deepcomm/cuda/arena.py over csrc/runtime/arena_core.hpp), on CPU: ranges are taken
from the free list, a range whose launch failed goes back with release(), freed neighbours coalesce; its views are
typed tensors over host memory here (DLPack, as over device memory on a GPU), and a range returns when the last
view of it, or of anything derived from one, dies, on whichever thread that happens."""
import gc
import threading

import pytest
import torch

from deepcomm._ext import load_extension
from deepcomm.cuda.arena import ALIGN, Arena

pytestmark = pytest.mark.skipif(load_extension() is None, reason="deepcomm._C is not built")


def _host_arena(nbytes):
    memory = torch.zeros(nbytes, dtype=torch.uint8)
    return memory, Arena(memory.data_ptr(), nbytes, None)


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


def test_trim_gives_the_tail_back_at_once():
    arena = Arena(0, 8 * ALIGN, torch.device("cpu"))
    off, size = arena.reserve(6 * ALIGN)
    assert arena.trim(off, size, ALIGN + 1) == (off, 2 * ALIGN)
    assert arena.free_bytes() == 6 * ALIGN and arena.releases == 0
    assert arena.trim(off, 2 * ALIGN, 0) == (off, ALIGN)  # never below one ALIGN


def test_views_are_typed_windows_of_the_range():
    memory, arena = _host_arena(16 * ALIGN)
    arena.reserve(ALIGN)  # the next range starts one ALIGN in
    off, size = arena.reserve(4 * ALIGN)
    specs = [(0, (4, 8), torch.bfloat16), (64, (4, 2), torch.float32), (128, (4, 2), torch.int64),
             (192, (3,), torch.int32), (256, (2, 8), torch.float8_e4m3fn), (512, (0, 7168), torch.bfloat16)]
    views = arena.views(off, size, specs)
    base = memory.data_ptr() + off
    for v, (at, shape, dtype) in zip(views, specs):
        assert v.dtype == dtype and tuple(v.shape) == shape and v.is_contiguous() and v.device.type == "cpu"
        assert v.data_ptr() == (base + at if v.numel() else 0)  # torch reports 0 for an empty tensor
    views[1].copy_(torch.arange(8, dtype=torch.float32).view(4, 2))
    assert torch.equal(memory[off + 64:off + 96].view(torch.float32), torch.arange(8, dtype=torch.float32))
    views[2][3, 1] = -(2 ** 40)
    assert int(memory[off + 128 + 56:off + 128 + 64].view(torch.int64)) == -(2 ** 40)
    memory[off + 256:off + 272] = 0x38  # e4m3 0x38 == 1.0
    assert torch.equal(views[4].float(), torch.ones(2, 8))


def test_the_range_returns_when_the_last_view_or_derived_tensor_dies():
    memory, arena = _host_arena(8 * ALIGN)
    off, size = arena.reserve(2 * ALIGN)
    x, w = arena.views(off, size, [(0, (4, 16), torch.bfloat16), (128, (4, 4), torch.float32)])
    rows = x[1:3].view(torch.int16)  # derived: holds the block too
    del x, w
    gc.collect()
    assert arena.free_bytes() == 6 * ALIGN and arena.releases == 0
    del rows
    assert arena.releases == 1 and arena.free_bytes() == 8 * ALIGN
    assert arena.reserve(8 * ALIGN) == (0, 8 * ALIGN)


def test_a_view_dropped_on_another_thread_gives_its_range_back():
    memory, arena = _host_arena(8 * ALIGN)
    off, size = arena.reserve(ALIGN)
    box = arena.views(off, size, [(0, (8,), torch.int64)])
    worker = threading.Thread(target=box.clear)
    worker.start()
    worker.join()
    assert arena.releases == 1 and arena.free_bytes() == 8 * ALIGN


def test_views_of_an_unowned_range_never_return_it():
    memory, arena = _host_arena(4 * ALIGN)
    bounce = (2 * ALIGN, 2 * ALIGN)  # past the part this arena hands out, as the bounce area is
    small = Arena(memory.data_ptr(), 2 * ALIGN, None)
    (v,) = small.views(*bounce, [(0, (4,), torch.float32)], owned=False)
    assert v.data_ptr() == memory.data_ptr() + 2 * ALIGN
    del v
    assert small.releases == 0 and small.free_bytes() == 2 * ALIGN


def test_a_view_outside_its_range_raises_and_leaves_the_range_reserved():
    memory, arena = _host_arena(4 * ALIGN)
    off, size = arena.reserve(ALIGN)
    with pytest.raises(IndexError, match="outside the range"):
        arena.views(off, size, [(0, (4,), torch.int32), (ALIGN - 8, (4,), torch.int32)])
    assert arena.releases == 0 and arena.free_bytes() == 3 * ALIGN
    with pytest.raises(IndexError, match="outside the arena"):
        arena.views(3 * ALIGN, 2 * ALIGN, [(0, (4,), torch.int32)])
    arena.release(off, size)
    assert arena.free_bytes() == 4 * ALIGN


@pytest.mark.parametrize("fp8_imported", [True, False])
@pytest.mark.parametrize("with_scales,with_idx,with_weights", [(False, False, False), (True, True, True),
                                                                (False, True, False), (True, False, True)])
def test_dispatch_views_sit_where_the_exported_layout_carves_the_block(fp8_imported, with_scales, with_idx,
                                                                       with_weights):
    C = load_extension()
    memory, arena = _host_arena(64 * ALIGN)
    if not fp8_imported:  # as on a torch whose DLPack importer lacks float8: made as bytes, viewed back
        arena._viewed = {torch.float8_e4m3fn: torch.uint8}
    elif arena._viewed:
        pytest.skip("this torch's DLPack importer does not make float8_e4m3fn")
    n, H, K = 5, 256, 3
    dtype = torch.float8_e4m3fn if with_scales else torch.bfloat16
    row = H * dtype.itemsize
    scale_row = H // 128 * 4 if with_scales else 0
    lay = C.dispatch_out_layout(n, row, scale_row, K)
    off, size = arena.reserve(lay["total"])
    x_type, x_view = arena.dlpack_type(dtype)
    assert (x_view is None) == (fp8_imported or dtype != torch.float8_e4m3fn)
    got = arena.core.dispatch_views(off, size, True, n, x_type, row, arena.dlpack_type(torch.float32)[0], scale_row,
                                    K, with_idx, with_weights)
    assert len(got) == 4
    x = got[0] if x_view is None else got[0].view(x_view)
    base = memory.data_ptr() + off
    assert x.dtype == dtype and tuple(x.shape) == (n, H) and x.data_ptr() == base + lay["x"]
    want = [(with_scales, "scales", (n, H // 128), torch.float32), (with_idx, "topk_idx", (n, K), torch.int64),
            (with_weights, "topk_weights", (n, K), torch.float32)]
    for t, (present, key, shape, dt) in zip(got[1:], want):
        if not present:
            assert t is None
            continue
        assert t.dtype == dt and tuple(t.shape) == shape and t.data_ptr() == base + lay[key]
    del x, got, t
    gc.collect()
    assert arena.free_bytes() == 64 * ALIGN  # the block came back with its last view


def test_dispatch_views_refuse_rows_that_are_not_whole_elements():
    memory, arena = _host_arena(8 * ALIGN)
    off, size = arena.reserve(4 * ALIGN)
    bf16 = arena.dlpack_type(torch.bfloat16)[0]
    with pytest.raises(ValueError, match="not whole elements"):
        arena.core.dispatch_views(off, size, True, 2, bf16, 63, 0, 0, 0, False, False)
    with pytest.raises((ValueError, IndexError), match="outside the range"):  # more rows than the range holds
        arena.core.dispatch_views(off, size, True, 64, bf16, 64, 0, 0, 0, False, False)


def test_into_block_keeps_trims_or_gives_back_the_block_by_the_launch_s_status():
    """ArenaCore.into_block, the arena side of NvlContext.dispatch_into (csrc/bindings/arena_views.hpp)."""
    C = load_extension()
    memory, arena = _host_arena(64 * ALIGN)
    bf16 = arena.dlpack_type(torch.bfloat16)[0]
    n, row = 4, 256
    used = C.dispatch_out_layout(n, row, 0, 0)["total"]
    offsets = []

    def into(need, status, waited=True, rows=n, fail=False):
        def launch(offset):
            offsets.append(offset)
            if fail:
                raise RuntimeError("launch failed")
            return status, rows, used, ("launched", offset)
        return arena.core.into_block(need, waited, bf16, row, 0, 0, 0, False, False, launch)

    full = 64 * ALIGN
    got, views = into(16 * ALIGN, 0)
    assert got == ("launched", 0) and views[0].shape == (n, 128) and views[1:] == (None, None, None)
    assert arena.free_bytes() == full - used  # trimmed to the rows' bytes
    del views
    gc.collect()
    assert arena.free_bytes() == full
    got, views = into(16 * ALIGN, 0, waited=False)
    assert arena.free_bytes() == full - 16 * ALIGN  # a call that did not wait keeps its whole block
    del views
    gc.collect()
    assert into(16 * ALIGN, 2) == (("launched", 0), None) and arena.free_bytes() == full  # bad counts: back
    assert into(16 * ALIGN, 1)[1] is None and arena.free_bytes() == full - 16 * ALIGN  # broken buffer: kept
    arena.release(0, 16 * ALIGN)
    with pytest.raises(RuntimeError, match="launch failed"):
        into(16 * ALIGN, 0, fail=True)
    assert arena.free_bytes() == full
    offsets.clear()
    assert into(full + ALIGN, 0) is None and offsets == []  # no block that large: nothing launched
