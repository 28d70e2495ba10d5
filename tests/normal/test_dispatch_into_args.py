"""NvlContext.dispatch_into, the crossing of every fresh and cached dispatch, reads its 34 positional arguments with
the C API (csrc/bindings/fast_method.hpp) rather than pybind11's dispatcher. On the CPU: a crossing that takes no
step (flags 0: nothing is launched, no CUDA call) still reserves its block of a host-memory arena and makes the
outputs' views for out_rows rows; wrong counts and wrong types raise TypeError naming the method and the argument,
and C++ errors leave as pybind11 would raise them."""
import gc

import pytest
import torch

from deepcomm._ext import load_extension
from deepcomm.cuda.arena import ALIGN, Arena

C = load_extension()
pytestmark = pytest.mark.skipif(C is None, reason="deepcomm._C is not built")

WORDS = tuple(range(16))


def _args(arena, rows=5, hidden=64, K=4, timeout=1.0, words=WORDS, with_idx=True, with_weights=True):
    bf16 = arena.dlpack_type(torch.bfloat16)[0]
    # arena, arena_at, reserve_rows, x_type, scale_type, with_idx, with_weights, flags, caller, comm, previous,
    # start, end, topk_idx, T, K, E, in_rank, send_pos, notify_out, host_tag, x, x_row_bytes, scales,
    # scale_row_bytes, topk_weights, count_matrix, invalid_count, out_rows, num_blocks, expert_alignment,
    # src_idx_copy, wait_timeout_s, fingerprint
    return [arena.core, 4096, 8, bf16, 0, with_idx, with_weights, 0, 0, 0, 0, 0, 0, 0, rows, K, 8, 0, 0, 0, 1, 0,
            2 * hidden, 0, 0, 0, 0, 0, rows, 24, 1, 0, timeout, words]


@pytest.fixture
def ctx_arena():
    memory = torch.zeros(64 * ALIGN * 64, dtype=torch.uint8)
    arena = Arena(memory.data_ptr(), memory.numel(), None)
    yield C.NvlContext(0, 1, 8, 128, 1024, 8, 1 << 20), arena, memory
    gc.collect()


def test_a_crossing_without_steps_makes_the_views_of_its_block(ctx_arena):
    ctx, arena, memory = ctx_arena
    status, n, bad_all, bad_mine, per_expert, views, waited = ctx.dispatch_into(*_args(arena))
    assert (status, n, bad_all, bad_mine, per_expert, waited) == (0, 5, 0, 0, [], 0.0)
    x, scales, idx, weights = views
    assert x.shape == (5, 64) and x.dtype == torch.bfloat16 and scales is None
    assert idx.shape == (5, 4) and idx.dtype == torch.int64 and weights.shape == (5, 4)
    assert x.data_ptr() == memory.data_ptr()  # the arena's first block
    lay = C.dispatch_out_layout(5, 128, 0, 4)
    assert idx.data_ptr() - x.data_ptr() == lay["topk_idx"] and weights.data_ptr() - x.data_ptr() == lay["topk_weights"]
    assert arena.free_bytes() < arena.nbytes  # a call without a wait keeps its whole block
    del x, idx, weights, views
    gc.collect()
    assert arena.free_bytes() == arena.nbytes
    _, _, _, _, _, (x, _, idx, w), _ = ctx.dispatch_into(*_args(arena, with_idx=False, with_weights=False))
    assert x.shape == (5, 64) and idx is None and w is None


def test_an_int_timeout_and_a_list_of_words_are_taken(ctx_arena):
    ctx, arena, _ = ctx_arena
    assert ctx.dispatch_into(*_args(arena, timeout=2, words=list(WORDS)))[1] == 5


@pytest.mark.parametrize("at, value, what", [
    (2, 8.0, "argument 3 must be an int"),                  # reserve_rows
    (5, 1, "argument 6 must be a bool"),                    # with_idx
    (8, -1, "argument 9 must be a non-negative int"),       # caller stream
    (14, 1 << 40, "argument 15 does not fit a 32-bit int"),  # T
    (32, "1", "argument 33 must be a float"),               # wait_timeout_s
    (33, WORDS[:15], "argument 34 must hold 16 ints"),      # fingerprint
    (33, WORDS[:15] + (1 << 33,), "argument 34 holds a value that does not fit an int32"),
    (33, 7, "argument 34 must be a sequence of ints"),
    (0, object(), "argument 1 must be a"),                  # not an ArenaCore
])
def test_a_wrong_argument_raises_type_error_naming_it(ctx_arena, at, value, what):
    ctx, arena, _ = ctx_arena
    args = _args(arena)
    args[at] = value
    with pytest.raises(TypeError, match="NvlContext.dispatch_into: " + what):
        ctx.dispatch_into(*args)
    assert arena.free_bytes() == arena.nbytes  # nothing reserved


def test_a_wrong_count_or_keywords_raise_type_error(ctx_arena):
    ctx, arena, _ = ctx_arena
    with pytest.raises(TypeError, match="takes 34 positional arguments, got 33"):
        ctx.dispatch_into(*_args(arena)[:-1])
    with pytest.raises(TypeError):
        ctx.dispatch_into(*_args(arena)[:-1], fingerprint=WORDS)
    with pytest.raises(TypeError):
        C.NvlContext.dispatch_into(object(), *_args(arena))  # not an NvlContext


def test_a_cpp_error_leaves_as_pybind11_would_raise_it(ctx_arena):
    """A host assertion (std::invalid_argument) becomes ValueError, as through pybind11's dispatcher; the block
    goes back to the arena."""
    ctx, arena, _ = ctx_arena
    args = _args(arena)
    args[7] = 4  # kCallBump without kCallPayload: refused by nvl_dispatch's host check
    with pytest.raises(ValueError, match="only a cached payload advances the call"):
        ctx.dispatch_into(*args)
    assert arena.free_bytes() == arena.nbytes
