"""NvlContext.combine_call, the crossing of every normal combine, reads its 20 positional arguments with the C API
(csrc/bindings/fast_method.hpp) rather than pybind11's dispatcher. On the CPU (no kernel can run): wrong counts and
wrong types raise TypeError naming the method and the argument before anything else happens, and a host check of
the combine's launcher (std::invalid_argument) leaves as ValueError, as through pybind11."""
import pytest

from deepcomm._ext import load_extension

C = load_extension()
pytestmark = pytest.mark.skipif(C is None, reason="deepcomm._C is not built")

WORDS = tuple(range(16))


def _args(num_blocks=0, use_fp8=False, words=WORDS):
    # flags, caller, comm, previous, start, end, num_blocks, x, topk_weights, recv_src_idx, count_matrix, send_pos,
    # out, out_weights, N, T, H, K, use_fp8, fingerprint. No stream order (flags 0, no events) and num_blocks 0:
    # the launcher's first host check refuses the call before any CUDA call.
    return [0, 0, 0, 0, 0, 0, num_blocks, 0, 0, 0, 0, 0, 0, 0, 4, 4, 64, 2, use_fp8, words]


@pytest.fixture
def ctx():
    return C.NvlContext(0, 1, 8, 128, 1024, 8, 1 << 20)


def test_the_launchers_host_check_raises_value_error(ctx):
    with pytest.raises(ValueError, match="combine: num_sms out of range"):
        ctx.combine_call(*_args())
    with pytest.raises(ValueError, match="combine: num_sms out of range"):  # a list of words is taken too
        ctx.combine_call(*_args(words=list(WORDS)))


@pytest.mark.parametrize("at, value, what", [
    (0, 1.0, "argument 1 must be an int"),                   # flags
    (1, -1, "argument 2 must be a non-negative int"),        # caller stream
    (6, 1 << 40, "argument 7 does not fit a 32-bit int"),    # num_blocks
    (7, None, "argument 8 must be an int"),                  # x
    (16, "64", "argument 17 must be an int"),                # H
    (18, 0, "argument 19 must be a bool"),                   # use_fp8
    (19, WORDS[:15], "argument 20 must hold 16 ints"),       # fingerprint
    (19, None, "argument 20 must be a sequence of ints"),
])
def test_a_wrong_argument_raises_type_error_naming_it(ctx, at, value, what):
    args = _args()
    args[at] = value
    with pytest.raises(TypeError, match="NvlContext.combine_call: " + what):
        ctx.combine_call(*args)


def test_a_wrong_count_or_keywords_raise_type_error(ctx):
    with pytest.raises(TypeError, match="takes 20 positional arguments, got 19"):
        ctx.combine_call(*_args()[:-1])
    with pytest.raises(TypeError):
        ctx.combine_call(*_args()[:-1], fingerprint=WORDS)
    with pytest.raises(TypeError):
        C.NvlContext.combine_call(object(), *_args())  # not an NvlContext
