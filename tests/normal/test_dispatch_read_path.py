"""Plain calls read by the C++ argument reader (Capabilities.reads_plain_calls, deepcomm/cuda/arg_reader.py) against
the Python path it replaces, on the CPU with the NVLink backend's stand-ins (tests/helpers/nvl_stand_ins.py): the
same crossing into C++ argument for argument, the same outputs and handle, for fresh and cached dispatches and
combines; through a Buffer, only plain calls take it, a refused argument still raises in Python and is rejected to
the peers, and a failure inside the backend is treated as on the Python path."""
import pytest
import torch

from deepcomm import agreement
from tests.helpers.multiproc import run_ranks
from tests.helpers.nvl_stand_ins import C, Patches, cpu_backend, put_behind_buffer

pytestmark = pytest.mark.skipif(C is None, reason="needs the extension deepcomm._C (its layouts and flags)")

TAG = 20  # NvlContext.dispatch_into's argument that numbers the host's counts (differs per call)


def _record(ctx) -> list:
    """Every dispatch_into crossing's arguments, in order."""
    seen, real = [], ctx.dispatch_into

    def into(*args):
        seen.append(args)
        return real(*args)
    ctx.dispatch_into = into
    return seen


def _inputs(kind: str, T=48, H=1024, K=4, E=8):
    idx = torch.randint(-1, E, (T, K), dtype=torch.int64)
    w = None if kind.endswith("no weights") else torch.rand(T, K)
    if kind.startswith("fp8"):
        scales = torch.rand(T, H // 128) if "fp32" in kind else torch.zeros(T, H // 512, dtype=torch.int32)
        return (torch.zeros(T, H, dtype=torch.float8_e4m3fn), scales), idx, w, E
    return torch.randn(T, H).to(torch.bfloat16), idx, w, E


def _summary(out):
    recv_x, recv_idx, recv_w, per_expert, h = out
    xs = recv_x if isinstance(recv_x, tuple) else (recv_x,)
    return ([(t.shape, t.dtype) for t in xs], None if recv_idx is None else recv_idx.shape,
            None if recv_w is None else recv_w.shape, per_expert,
            (h.num_experts, h.num_tokens, h.hidden, h.num_recv, h.num_recv_tokens_per_expert))


def _reader(b):
    if b.arg_reader is None:
        pytest.skip("this torch has no DLPack exchange table")
    return b.arg_reader


@pytest.mark.parametrize("kind", ["bf16", "bf16 no weights", "fp8 fp32", "fp8 ue8m0 no weights"])
@pytest.mark.parametrize("alignment", [1, 4])
def test_read_path_makes_the_python_paths_crossing(monkeypatch, kind, alignment):
    env = cpu_backend(monkeypatch.setattr)
    b, ctx = env.b, env.ctx
    reader = _reader(b)
    seen = _record(ctx)
    x, idx, w, E = _inputs(kind)
    python = b.dispatch(x, idx, w, E, None, alignment, fingerprint=agreement.dispatch(5, 2, x, idx, w, E, None))
    expected = _summary(python)
    del python  # its block and workspace go back: the read call is given the same ones
    read = reader.fresh(x, idx, w, E, 5, 2)
    assert read is not None
    got = b.dispatch_read(read, E, alignment)
    assert _summary(got) == expected
    first, second = seen
    assert first[TAG] + 1 == second[TAG]
    assert first[:TAG] + first[TAG + 1:] == second[:TAG] + second[TAG + 1:]
    # a cached dispatch of that handle, without topk_idx
    h = got[-1]
    h.call = 5
    words = agreement.dispatch(6, 2, x, None, w, None, h)
    python = _summary(b.dispatch(x, None, w, E, h, 1, fingerprint=words))
    read = reader.cached(x, w, h.num_tokens, h.num_experts, h.call, 6, 2)
    assert read is not None and read[-1] == words
    assert _summary(b.dispatch_read(read, None, 1, h)) == python
    assert seen[2] == seen[3]


@pytest.mark.parametrize("use_fp8", [False, True])
@pytest.mark.parametrize("weights", [False, True])
def test_combine_read_makes_the_python_paths_crossing(monkeypatch, use_fp8, weights):
    env = cpu_backend(monkeypatch.setattr)
    b, ctx = env.b, env.ctx
    reader = _reader(b)
    x, idx, w, E = _inputs("bf16")
    *_, h = b.dispatch(x, idx, w, E, None, 1, fingerprint=agreement.dispatch(1, 2, x, idx, w, E, None))
    h.call = 1
    y = torch.randn(h.num_recv, x.shape[1]).to(torch.bfloat16)
    yw = torch.rand(h.num_recv, idx.shape[1]) if weights else None
    combined = []
    real = ctx.combine_call
    ctx.combine_call = lambda *args: combined.append(args) or real(*args)
    words = agreement.combine(2, 2, y, h, yw, use_fp8)
    out, out_w = b.combine(y, h, yw, use_fp8=use_fp8, fingerprint=words)
    read = reader.combine(y, yw, h.num_recv, use_fp8, h.call, 2, 2)
    assert read is not None and read[-1] == words
    out2, out_w2 = b.combine_read(read, h)
    assert (out.shape, out.dtype) == (out2.shape, out2.dtype) and (out_w is None) == (out_w2 is None)
    first, second = combined
    # the same crossing but for the output tensors' addresses (each call allocates its own)
    assert first[:12] == second[:12] and first[14:] == second[14:]
    assert reader.combine(y, yw, h.num_recv + 1, use_fp8, h.call, 2, 2) is None  # rows are not the handle's
    assert reader.combine(y, yw, h.num_recv, 1, h.call, 2, 2) is None  # use_fp8 not a bool: the Python path names it


def _buffer_over_stand_in(patches):
    """A world-size-1 Buffer whose backend is the stand-in CUDA backend (as dev/profile_host_cpu.py builds it)."""
    import deepcomm
    buf = deepcomm.Buffer(max_tokens_per_rank=256, hidden=1024, backend="reference")
    state = cpu_backend(patches.setattr)
    put_behind_buffer(buf, state.b)
    return buf, state


def _through_a_buffer(rank, world):
    patches = Patches()
    out = {}
    try:
        buf, state = _buffer_over_stand_in(patches)
        b, ctx = state.b, state.ctx
        seen = _record(ctx)
        reads, rejects = [], []
        real_read, real_combine_read = b.dispatch_read, b.combine_read
        b.dispatch_read = lambda *a: reads.append(a[0]) or real_read(*a)
        b.combine_read = lambda *a: reads.append(a[0]) or real_combine_read(*a)
        b.reject = lambda words, handle=None: rejects.append(tuple(words))  # the stand-in has no exchange to join
        x, idx, w, E = _inputs("bf16")
        h = buf.dispatch(x, idx, w, num_experts=E)[-1]
        out["plain read"] = len(reads) == 1 and h.call == buf._calls == 1
        words = agreement.dispatch(1, buf._buffer_word, x, idx, w, E, None, buf.num_sms)
        out["plain words"] = tuple(seen[-1][-1]) == words
        # a cached dispatch and a combine of the handle
        recv_x = buf.dispatch(x, handle=h)[0]
        buf.combine(recv_x, h)
        out["cached and combine read"] = len(reads) == 3 and len(seen) == 2
        # not plain: the Python path (async_finish, num_worst_tokens, a cached call given topk_idx, an async combine)
        buf.dispatch(x, idx, w, num_experts=E, async_finish=True)
        buf.dispatch(x, idx, w, num_experts=E, num_worst_tokens=64)
        buf.dispatch(x, idx, handle=h)
        buf.combine(recv_x, h, async_finish=True)
        out["others python"] = len(reads) == 3 and len(seen) == 5
        # a refused argument: the Python checks name it, and the call is rejected to the peers (REJECTED word)
        try:
            buf.dispatch(x, idx.int(), w, num_experts=E)
        except ValueError as e:
            out["refused"] = str(e).split(":")[0]
        out["refused rejected"] = (len(rejects) == 1 and rejects[0][agreement.Word.REJECTED] != 0
                                   and rejects[0][agreement.Word.CALL] == buf._calls)
        # a failure inside the backend before the crossing: never joined, so rejected too (as on the Python path)
        real_fresh = b._fresh
        b._fresh = lambda *a: (_ for _ in ()).throw(RuntimeError("simulated, before the crossing"))
        try:
            buf.dispatch(x, idx, w, num_experts=E)
        except RuntimeError as e:
            out["before crossing"] = str(e)
        b._fresh = real_fresh
        out["before crossing rejected"] = len(rejects) == 2
        # a failure in the crossing: joined, not rejected; the Buffer is broken with the reason
        ctx.dispatch_into = lambda *a: (_ for _ in ()).throw(RuntimeError("simulated launch failure"))
        try:
            buf.dispatch(x, idx, w, num_experts=E)
        except RuntimeError as e:
            out["crossing"] = str(e)
        out["crossing rejected"] = len(rejects) != 2
        out["broken"] = b.nvl.broken_reason is not None
    finally:
        patches.undo()
    return out


def test_a_buffer_takes_the_read_path_for_plain_calls_only():
    (out,) = run_ranks(_through_a_buffer, 1, timeout=120)
    assert out["plain read"] and out["plain words"] and out["cached and combine read"], out
    assert out["others python"], out
    assert out["refused"] == "topk_idx" and out["refused rejected"], out
    assert out["before crossing"] == "simulated, before the crossing" and out["before crossing rejected"], out
    assert out["crossing"] == "simulated launch failure" and not out["crossing rejected"] and out["broken"], out
