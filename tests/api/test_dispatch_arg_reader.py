"""deepcomm._C.DispatchArgReader (csrc/bindings/dispatch_args.cpp) against the Python checks it stands in for on
plain calls (fresh and cached dispatch, combine): it accepts only what deepcomm/validation.py accepts (None
otherwise), reads the same sizes and addresses, and makes the words agreement makes, on random and ugly inputs (CPU
tensors: device -1)."""
import random
import types

import pytest
import torch

from deepcomm import agreement
from deepcomm import validation as v
from deepcomm._ext import load_extension

C = load_extension()
pytestmark = pytest.mark.skipif(C is None, reason="deepcomm._C is not built")

CPU = torch.device("cpu")
R, MAX_HIDDEN, MAX_TOKENS = 4, 1024, 64
FP8 = torch.float8_e4m3fn


def _reader(stream=None):
    from deepcomm.cuda.arg_reader import dispatch_arg_reader
    reader = dispatch_arg_reader(C, R, -1, MAX_HIDDEN, MAX_TOKENS, stream)
    if reader is None:
        pytest.skip("this torch has no DLPack exchange table (torch.Tensor.__dlpack_c_exchange_api__)")
    return reader


def _python_accepts(x, idx, w, E) -> bool:
    """What the Buffer's Python path accepts for a fresh dispatch of the CUDA backend (bf16 or an FP8 pair)."""
    try:
        T, _, _ = v.check_dispatch_x(x, CPU, (torch.bfloat16,), MAX_HIDDEN, MAX_TOKENS)
        if not v.routing_accepted(idx, w, T, E, R, CPU):
            v.check_num_experts(E, R)
            v.check_topk_idx(idx, T, E, CPU, check_values=False)
            if w is not None:
                v.check_topk_weights(w, tuple(idx.shape), CPU)
    except ValueError:
        return False
    return True


def _case(rng: random.Random, T=None, H=None, K=None, fp8=None, scales="fp32", weights=True):
    T = rng.randint(0, MAX_TOKENS) if T is None else T
    K = rng.randint(0, v.MAX_TOPK) if K is None else K
    fp8 = rng.random() < 0.5 if fp8 is None else fp8
    if H is None:
        H = rng.choice([512, 1024] if scales == "ue8m0" else [128, 256, 896, 1024]) if fp8 else 8 * rng.randint(0, 128)
    E = R * rng.randint(1, 64)
    idx = torch.randint(-1, E, (T, K), dtype=torch.int64)
    w = torch.rand(T, K) if weights else None
    if fp8:
        values = torch.zeros(T, H, dtype=FP8)
        sc = torch.rand(T, H // 128) if scales == "fp32" else torch.zeros(T, H // 512, dtype=torch.int32)
        x = (values, sc)
    else:
        x = torch.randn(T, H).to(torch.bfloat16)
    return x, idx, w, E


def _check_read(read, x, idx, w, E, call, buffer):
    values, scales = (x[0], x[1]) if isinstance(x, (tuple, list)) else (x, None)
    T, H = values.shape
    assert read[:4] == (T, H, idx.shape[1], 0)
    assert read[4] is values.dtype and read[5] is (None if scales is None else scales.dtype)
    assert read[6] == H * values.element_size()
    assert read[7] == (0 if scales is None else scales.shape[1] * 4)
    assert read[8] == values.data_ptr() and read[9] == (0 if scales is None else scales.data_ptr())
    assert read[10] == idx.data_ptr() and read[11] == (0 if w is None else w.data_ptr())
    assert read[12] is (w is not None)
    assert read[13] == agreement.dispatch(call, buffer, x, idx, w, E, None)


@pytest.mark.parametrize("seed", range(6))
def test_accepted_inputs_read_as_python_reads_them(seed):
    rng = random.Random(seed)
    reader = _reader()
    for i in range(60):
        x, idx, w, E = _case(rng, scales=rng.choice(["fp32", "ue8m0"]), weights=rng.random() < 0.7)
        assert _python_accepts(x, idx, w, E)
        call, buffer = rng.randint(1, 2 ** 40), rng.randint(0, 9)
        read = reader.fresh(x, idx, w, E, call, buffer)
        assert read is not None, (i, type(x))
        _check_read(read, x, idx, w, E, call, buffer)


def _ugly(rng: random.Random):
    """A case with one thing wrong (or odd but valid), and what was done."""
    x, idx, w, E = _case(rng, T=rng.randint(1, MAX_TOKENS), K=rng.randint(1, 8), fp8=rng.random() < 0.4)
    fp8 = isinstance(x, tuple)
    what = rng.choice(["x dtype", "x 3-D", "x strided", "x offset", "x hidden", "x too wide", "x too many rows",
                       "x subclass", "x list pair", "x triple", "scales shape", "scales dtype", "scales strided",
                       "idx dtype", "idx rows", "idx 1-D", "idx wide", "idx strided", "w dtype", "w shape",
                       "w strided", "E bool", "E float", "E uneven", "E zero", "E huge", "E none", "idx none",
                       "nothing"])
    values = x[0] if fp8 else x
    if what == "x dtype":
        values = values.to(torch.float32)
    elif what == "x 3-D":
        values = values.unsqueeze(0)
    elif what == "x strided":
        values = torch.cat([values, values], 1)[:, ::2]
    elif what == "x offset":  # a view at an 8-byte offset: not 16-byte aligned
        flat = torch.zeros(values.numel() * values.element_size() + 16, dtype=torch.uint8)
        values = flat[8:8 + values.numel() * values.element_size()].view(values.dtype).view(values.shape)
    elif what == "x hidden":
        values = torch.zeros(values.shape[0], values.shape[1] + (64 if fp8 else 4), dtype=values.dtype)
    elif what == "x too wide":
        values = torch.zeros(values.shape[0], MAX_HIDDEN + 128, dtype=values.dtype)
    elif what == "x too many rows":
        values = torch.zeros(MAX_TOKENS + 1, values.shape[1], dtype=values.dtype)
    elif what == "x subclass":  # accepted by Python, left to it by the reader
        values = torch.nn.Parameter(values, requires_grad=False)
    if fp8:
        sc = x[1]
        if what == "scales shape":
            sc = torch.zeros(sc.shape[0], sc.shape[1] + 1, dtype=sc.dtype)
        elif what == "scales dtype":
            sc = sc.to(torch.float64)
        elif what == "scales strided":
            sc = torch.cat([sc, sc], 1)[:, ::2]
        x = [values, sc] if what == "x list pair" else (values, sc, sc) if what == "x triple" else (values, sc)
    else:
        x = values
    if what == "idx dtype":
        idx = idx.to(torch.int32)
    elif what == "idx rows":
        idx = torch.zeros(idx.shape[0] + 1, idx.shape[1], dtype=torch.int64)
    elif what == "idx 1-D":
        idx = idx[:, 0].contiguous()
    elif what == "idx wide":
        idx = torch.zeros(idx.shape[0], v.MAX_TOPK + 1, dtype=torch.int64)
    elif what == "idx strided":
        idx = torch.cat([idx, idx], 1)[:, ::2]
    elif what == "idx none":
        idx = None
    if w is not None:
        if what == "w dtype":
            w = w.double()
        elif what == "w shape" and idx is not None and idx.dim() == 2:
            w = torch.rand(idx.shape[0], idx.shape[1] + 1)
        elif what == "w strided":
            w = torch.cat([w, w], 1)[:, ::2]
    E = {"E bool": True, "E float": float(E), "E uneven": E + 1, "E zero": 0, "E huge": R * 2 ** 30,
         "E none": None}.get(what, E)
    return what, x, idx, w, E


@pytest.mark.parametrize("seed", range(8))
def test_reader_accepts_only_what_python_accepts(seed):
    """Ugly inputs: whatever the reader accepts, Python accepts too and reads the same; what Python refuses, the
    reader refuses; tensor subclasses (and calls past int32 num_experts) are left to Python either way."""
    rng = random.Random(1000 + seed)
    reader = _reader()
    for _ in range(80):
        what, x, idx, w, E = _ugly(rng)
        read = reader.fresh(x, idx, w, E, 7, 1)
        python = _python_accepts(x, idx, w, E)
        if read is not None:
            assert python, what
            _check_read(read, x, idx, w, E, 7, 1)
        elif what not in ("x subclass", "E huge"):
            assert not python, what


def test_reader_asks_the_stream_query_with_the_device_index():
    asked = []
    reader = _reader(lambda index: asked.append(index) or 12345)
    x, idx, w, E = _case(random.Random(3), T=4, K=2, fp8=False)
    assert reader.fresh(x, idx, w, E, 1, 0)[3] == 12345 and asked == [-1]
    failing = _reader(lambda index: 1 / 0)  # a query that raises: left to the Python path, the error cleared
    assert failing.fresh(x, idx, w, E, 1, 0) is None


def test_reader_refuses_bad_call_numbers_and_argument_counts():
    reader = _reader()
    x, idx, w, E = _case(random.Random(4), T=2, K=1, fp8=False)
    with pytest.raises(TypeError, match="call and buffer"):
        reader.fresh(x, idx, w, E, "1", 0)
    with pytest.raises(TypeError, match="takes 6 positional arguments"):
        reader.fresh(x, idx, w, E)


def test_reader_layout_checks():
    from deepcomm.cuda.arg_reader import READ_DTYPES, exchange_api
    api = exchange_api()
    if api is None:
        pytest.skip("this torch has no DLPack exchange table")
    samples = {name: torch.empty(0, dtype=getattr(torch, name)) for name in READ_DTYPES}
    limits = dict(num_ranks=0, device=-1, max_hidden=8, max_tokens=8, row_align=8, data_align=16, max_topk=32,
                  block=128)
    at = {w.name: int(w) for w in agreement.Word}
    layout = dict(words=16, magic=1, call_mask=1, op_dispatch=1, op_combine=2, at=at, bf16_code=1, fp8_code=5,
                  scales_fp32=1, scales_ue8m0=2)
    with pytest.raises(ValueError, match="num_ranks"):
        C.DispatchArgReader(api, torch.Tensor, samples, limits, layout, None)
    limits["num_ranks"] = 1
    with pytest.raises(ValueError, match="outside the fingerprint"):
        C.DispatchArgReader(api, torch.Tensor, samples, limits, dict(layout, at=dict(at, TOPK=16)), None)
    with pytest.raises(ValueError, match="cannot be described"):
        C.DispatchArgReader(api, torch.Tensor, dict(samples, int64=[1]), limits, layout, None)


def test_tensors_that_require_grad_are_read():
    """Training passes activations that require grad: the table describes them (no detach needed)."""
    reader = _reader()
    x, idx, w, E = _case(random.Random(5), T=8, K=2, fp8=False)
    x = x.float().requires_grad_().to(torch.bfloat16)
    read = reader.fresh(x, idx, w, E, 1, 0)
    assert read is not None
    _check_read(read, x, idx, w, E, 1, 0)


def _python_accepts_cached(x, w, num_tokens) -> bool:
    try:
        T, _, _ = v.check_dispatch_x(x, CPU, (torch.bfloat16,), MAX_HIDDEN, MAX_TOKENS)
        if T != num_tokens:
            return False
        if w is not None:
            v.check_topk_weights(w, (T, None), CPU)
    except ValueError:
        return False
    return True


def _python_accepts_combine(x, w, num_recv, use_fp8) -> bool:
    try:
        v.check_combine_x(x, types.SimpleNamespace(num_recv=num_recv), CPU, (torch.bfloat16,), MAX_HIDDEN, use_fp8)
        if w is not None:
            v.check_topk_weights(w, (num_recv, None), CPU)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("seed", range(6))
def test_cached_reads_agree_with_python(seed):
    """A cached dispatch (no topk_idx): the payload as a fresh one's, the handle's token count, the weights' shape;
    its words agreement.dispatch's with the handle's number and num_experts."""
    rng = random.Random(2000 + seed)
    reader = _reader()
    for _ in range(80):
        what, x, idx, w, E = _ugly(rng)
        values = x[0] if isinstance(x, (tuple, list)) else x
        T = values.shape[0] if values.dim() >= 1 else 0
        num_tokens = T + (1 if rng.random() < 0.1 else 0)
        handle = types.SimpleNamespace(num_experts=R * 8, call=rng.randint(1, 2 ** 33))
        read = reader.cached(x, w, num_tokens, handle.num_experts, handle.call, 9, 3)
        python = _python_accepts_cached(x, w, num_tokens)
        if read is not None:
            assert python, what
            values, scales = (x[0], x[1]) if isinstance(x, (tuple, list)) else (x, None)
            K = w.shape[1] if w is not None else 0
            assert read[:3] == (T, values.shape[1], K) and read[10] == 0 and read[12] is (w is not None)
            assert read[13] == agreement.dispatch(9, 3, x, None, w, None, handle)
        elif what not in ("x subclass",) and not (w is not None and w.dim() == 2 and w.shape[1] > v.MAX_TOPK):
            assert not python, what


@pytest.mark.parametrize("seed", range(6))
def test_combine_reads_agree_with_python(seed):
    rng = random.Random(3000 + seed)
    reader = _reader()
    for _ in range(80):
        N, H, K = rng.randint(0, 80), rng.choice([8, 128, 1000, 1024, 1032]), rng.randint(0, 8)
        x = torch.randn(N, H).to(torch.bfloat16)
        w = torch.rand(N, K) if rng.random() < 0.6 else None
        use_fp8 = rng.random() < 0.3
        what = rng.choice(["rows", "dtype", "strided", "3-D", "w rows", "w dtype", "fp8 flag int", "nothing",
                           "nothing", "subclass"])
        num_recv = N + 1 if what == "rows" else N
        if what == "dtype":
            x = x.float()
        elif what == "strided":
            x = torch.cat([x, x], 1)[:, ::2]
        elif what == "3-D":
            x = x.unsqueeze(0)
        elif what == "w rows" and w is not None:
            w = torch.rand(N + 1, K)
        elif what == "w dtype" and w is not None:
            w = w.double()
        elif what == "fp8 flag int":
            use_fp8 = int(use_fp8)
        elif what == "subclass":
            x = torch.nn.Parameter(x, requires_grad=False)
        call = types.SimpleNamespace(call=rng.randint(1, 2 ** 33))
        read = reader.combine(x, w, num_recv, use_fp8, call.call, 11, 4)
        python = _python_accepts_combine(x, w, num_recv, use_fp8)
        if read is not None:
            assert python, what
            assert read[:3] == (N, H, 0 if w is None else K) and read[3] == 0 and read[4] == x.data_ptr()
            assert read[5] == (0 if w is None else w.data_ptr()) and read[6] is (w is not None)
            assert read[7] is use_fp8 and read[8] == agreement.combine(11, 4, x, call, w, use_fp8)
        elif what not in ("subclass", "fp8 flag int"):
            assert not python, what


def test_the_words_carry_the_num_sms_set_on_the_reader():
    """Every read's NUM_SMS word is the one the Buffer last gave the reader (set_num_sms), as agreement makes it."""
    reader = _reader()
    x, idx, w = torch.randn(4, 256).to(torch.bfloat16), torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 2)
    handle = types.SimpleNamespace(num_experts=R * 8, call=7)
    for n in (24, 132, 0, 3):
        reader.set_num_sms(n)
        fresh = reader.fresh(x, idx, w, R * 8, 5, 1)[13]
        assert fresh == agreement.dispatch(5, 1, x, idx, w, R * 8, None, n) and fresh[agreement.Word.NUM_SMS] == n
        assert reader.cached(x, w, 4, handle.num_experts, handle.call, 6, 1)[13] == \
            agreement.dispatch(6, 1, x, None, w, None, handle, n)
        assert reader.combine(x, w, 4, False, handle.call, 8, 1)[8] == agreement.combine(8, 1, x, handle, w, False, n)


def test_a_table_the_reader_cannot_use_turns_it_off(monkeypatch):
    """A capsule that is not a DLPack exchange table (or a table that cannot describe a dtype the calls use): no
    reader, so every call takes the Python checks, and the arena's views go out as capsules."""
    import ctypes
    from deepcomm.cuda import arg_reader
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    keep = ctypes.c_int(0)
    foreign = new(ctypes.addressof(keep), b"not_a_table", None)
    monkeypatch.setattr(arg_reader, "exchange_api", lambda: foreign)
    assert arg_reader.dispatch_arg_reader(C, R, -1, MAX_HIDDEN, MAX_TOKENS) is None
    # the arena makes its views as DLPack capsules then
    from deepcomm.cuda.arena import ALIGN, _dlpack_importer
    memory = torch.zeros(4096, dtype=torch.uint8)
    core = C.ArenaCore(memory.data_ptr(), 4096, ALIGN, C.DLPACK_CPU, 0, _dlpack_importer(), foreign)
    (view,) = core.views(0, 64, False, ((0, (16,), 0, 32),))
    assert view.dtype == torch.int32 and view.data_ptr() == memory.data_ptr()
