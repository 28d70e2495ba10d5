"""Call fingerprints (deepcomm/agreement.py): the word layout, the check's messages, and, on 2 and 3 gloo processes
with the reference backend and default settings, every way ranks can disagree about a call: each raises ValueError
on every rank naming the argument (a rank whose own validation failed raises its own error, the others name it),
no rank runs the call, and the Buffer's next agreeing call gives the same result as on a fresh Buffer. A rank that
skips a call makes the others time out; the Buffer then says it must be rebuilt, and a rebuilt one works."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deepcomm import agreement
from deepcomm.agreement import Word
from tests.helpers.multiproc import run_ranks

H, E, M = 256, 12, 8  # E: a multiple of 2 and 3


# ---- the words and the check, in one process ------------------------------------------------------------------
def test_make_lays_the_words_out_in_word_order():
    names = ["rejected", "hidden", "x_dtype", "scales", "topk", "num_experts", "handle", "ll_max_tokens", "num_sms"]
    values = {n: 100 + i for i, n in enumerate(names)}
    words = agreement.make(3, 41, 7, weights=True, use_fp8=True, use_ue8m0=True, **values)
    assert len(words) == agreement.WORDS == len(Word) == 16
    assert words[Word.MAGIC] == agreement.MAGIC and words[Word.OP] == 3
    assert words[Word.CALL] == 41 and words[Word.BUFFER] == 7
    for n in names:
        assert words[Word[n.upper()]] == values[n], n
    assert words[Word.WEIGHTS] == words[Word.USE_FP8] == words[Word.USE_UE8M0] == 1
    assert agreement.make(1, 2 ** 31 + 5, 0)[Word.CALL] == 5  # int32 on the device: wraps


def test_every_word_fits_int32():
    x = torch.zeros(4, 7168, dtype=torch.bfloat16)
    words = agreement.dispatch(2 ** 40, 3, x, torch.zeros(4, 8, dtype=torch.int64), None, 256, None)
    assert all(-2 ** 31 <= w < 2 ** 31 for w in words)
    assert torch.tensor(words, dtype=torch.int32).tolist() == list(words)


def _rows(*changes, world=2, op=agreement.Op.DISPATCH):
    """``world`` copies of one fingerprint; ``changes``: (rank, word, value)."""
    base = agreement.make(op, 5, 1, hidden=H, x_dtype=1, topk=2, weights=True, num_experts=E)
    rows = [list(base) for _ in range(world)]
    for r, w, value in changes:
        rows[r][w] = value
    return rows


def _message(rows) -> str:
    with pytest.raises(ValueError) as info:
        agreement.check(rows)
    return str(info.value)


def test_check_passes_equal_words_and_names_what_differs():
    agreement.check(_rows(world=3))
    msg = _message(_rows((1, Word.NUM_EXPERTS, 24)))
    assert msg.startswith("num_experts: the value differs across ranks in dispatch call #5 on this Buffer: "
                          "12 on rank 0 vs 24 on rank 1."), msg
    msg = _message(_rows((1, Word.HIDDEN, 4096), world=3))
    assert msg.startswith("x: the hidden size differs") and "256 on ranks 0, 2 vs 4096 on rank 1" in msg, msg
    msg = _message(_rows((0, Word.X_DTYPE, 5), (0, Word.SCALES, 1)))
    assert msg.startswith("x: the dtype differs") and "float8_e4m3fn on rank 0 vs bfloat16 on rank 1" in msg, msg
    assert "also x[1] (the FP8 scale format): fp32" in msg, msg
    msg = _message(_rows((1, Word.WEIGHTS, 0), (1, Word.TOPK, 0), op=agreement.Op.COMBINE))
    assert msg.startswith("topk_weights: whether it is given differs") and "also topk_weights (the top-k" in msg
    assert _message(_rows((1, Word.TOPK, 3))).startswith("topk_idx: the top-k differs")
    assert _message(_rows((1, Word.HANDLE, 3))).startswith("handle: which handle differs")
    assert "none (a fresh dispatch) on rank 0 vs the handle of call #3 on rank 1" in _message(_rows((1, Word.HANDLE, 3)))
    for word, arg in [(Word.LL_MAX_TOKENS, "num_max_dispatch_tokens_per_rank"), (Word.USE_FP8, "use_fp8"),
                      (Word.USE_UE8M0, "use_ue8m0"), (Word.NUM_SMS, "num_sms")]:
        assert _message(_rows((1, word, 1))).startswith(f"{arg}: "), word
    msg = _message(_rows((0, Word.NUM_SMS, 24), (1, Word.NUM_SMS, 20)))
    assert msg == ("num_sms: the Buffer's setting differs across ranks in dispatch call #5 on this Buffer: 24 on "
                   "rank 0 vs 20 on rank 1. Every rank must set the same; no rank ran the call"), msg


def test_check_names_the_call_order_and_rejecting_ranks_first():
    msg = _message(_rows((1, Word.OP, agreement.Op.COMBINE), (1, Word.HIDDEN, 1)))
    assert msg.startswith("call order: the ranks are in different calls on this Buffer (dispatch #5 on rank 0 vs "
                          "combine #5 on rank 1)"), msg
    assert _message(_rows((1, Word.CALL, 6))).startswith("call order: ")
    assert _message(_rows((1, Word.BUFFER, 2))).startswith("call order: ranks are in calls of different Buffers")
    code = agreement.reject_code(ValueError("topk_idx: expert ids must be < 12"))
    rejected = agreement.make(agreement.Op.DISPATCH, 5, 1, rejected=code)
    msg = _message([_rows()[0], rejected, _rows()[0]])
    assert msg == ("topk_idx: rank 1 rejected dispatch call #5 on this Buffer (see that rank's error); "
                   "no rank ran the call"), msg
    other = agreement.make(agreement.Op.DISPATCH, 5, 1, rejected=agreement.reject_code(TypeError("boom")))
    assert _message([other, rejected]).startswith("call: ranks 0, 1 rejected dispatch call #5 on this Buffer "
                                                  "(their errors name call on rank 0, topk_idx on rank 1)")
    assert _message([_rows()[0], [0] * agreement.WORDS]).startswith("fingerprint: rank 1 sent words that are not")


def test_reject_codes():
    assert agreement.reject_code(ValueError("x[1]: expected shape")) == 1 + agreement.REJECT_ARGS.index("x[1]")
    assert agreement.reject_code(ValueError("no argument here")) == agreement.REJECT_OTHER
    assert agreement.reject_code(RuntimeError("topk_idx: not a ValueError")) == agreement.REJECT_OTHER


# ---- every case of disagreement, on gloo processes ----------------------------------------------------------
def _buffer(**kw):
    import deepcomm
    args = dict(backend="reference", hidden=7168, max_tokens_per_rank=M, num_max_low_latency_tokens=M,
                timeout_s=30.0)
    args.update(kw)
    return deepcomm.Buffer(**args)


def _inputs(rank, T=5, K=2, hidden=H, seed=0):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(T, hidden, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return x, idx, torch.rand(T, K, generator=gen)


def _step(buf, rank):
    """One agreeing round of every kind of call; its outputs."""
    from deepcomm.fp8 import per_token_cast_to_fp8
    x, idx, w = _inputs(rank, seed=1)
    recv_x, _, recv_w, _, handle = buf.dispatch(x, idx, w, num_experts=E)
    combined, combined_w = buf.combine(recv_x, handle, recv_w)
    again, _, _, _, _ = buf.dispatch(x, handle=handle)
    fp8, _, _, _, _ = buf.dispatch(per_token_cast_to_fp8(x), handle=handle)
    ll_x, ll_count, ll_handle, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    ll_out, _ = buf.low_latency_combine(ll_x, idx, w, ll_handle)
    return [recv_x, combined, combined_w, again, fp8[0].view(torch.uint8), fp8[1], ll_x, ll_count, ll_out]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))


def _raises(fn):
    """The ValueError text ``fn`` raises ("returned" when none)."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "returned"


def _with_num_sms(buf, num_sms, call):
    """``call()`` with the Buffer's num_sms set to ``num_sms`` (set back after)."""
    before = buf.num_sms
    buf.set_num_sms(num_sms)
    try:
        return call()
    finally:
        buf.set_num_sms(before)


def _disagreements(rank, world):
    from deepcomm.fp8 import pack_ue8m0, per_token_cast_to_fp8
    buf = _buffer()
    fresh = _step(_buffer(), rank)
    odd = world - 1  # the rank that differs
    me = rank == odd
    x, idx, w = _inputs(rank)
    big, big_idx, big_w = _inputs(rank, hidden=7168 if me else 4096)
    recv_x, _, recv_w, _, handle = buf.dispatch(x, idx, w, num_experts=E)
    buf.dispatch(x, handle=handle)
    ll_x, _, ll_handle, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    wide = per_token_cast_to_fp8(_inputs(rank, hidden=512)[0], use_ue8m0=True)
    bad = idx.clone()
    bad[0, 0] = E if me else bad[0, 0]  # out of range on one rank only
    cases = {
        "one rank's own ValueError": lambda: buf.dispatch(x, bad, w, num_experts=E),
        "num_experts 12 vs 24": lambda: buf.dispatch(x, idx, w, num_experts=24 if me else 12),
        "low-latency cap": lambda: buf.low_latency_dispatch(x, idx, M - 1 if me else M, E, use_fp8=False),
        "hidden 7168 vs 4096": lambda: buf.dispatch(big, big_idx, big_w, num_experts=E),
        "hidden in combine": lambda: buf.combine(torch.zeros(recv_x.shape[0], 128 if me else H,
                                                             dtype=torch.bfloat16), handle, recv_w),
        "top-k": lambda: buf.dispatch(*_inputs(rank, K=3 if me else 2), num_experts=E),
        "weights in dispatch": lambda: buf.dispatch(x, idx, w if me else None, num_experts=E),
        "weights in cached dispatch": lambda: buf.dispatch(x, handle=handle, topk_weights=None if me else w),
        "weights in combine": lambda: buf.combine(recv_x, handle, recv_w if me else None),
        "FP8 vs BF16": lambda: buf.dispatch(per_token_cast_to_fp8(x) if me else x, idx, w, num_experts=E),
        "UE8M0 vs fp32 scales": lambda: buf.dispatch((wide[0], pack_ue8m0(wide[1]) if me else wide[1]), idx, w,
                                                     num_experts=E),
        "use_fp8 in low_latency_dispatch": lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=me),
        "use_ue8m0": lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=True, use_ue8m0=me),
        "use_fp8 in combine": lambda: buf.combine(recv_x, handle, recv_w, use_fp8=me),
        "use_fp8 in low_latency_combine": lambda: buf.low_latency_combine(ll_x, idx, w, ll_handle, use_fp8=me),
        "num_sms in dispatch": lambda: _with_num_sms(buf, 20 if me else 24,
                                                     lambda: buf.dispatch(x, idx, w, num_experts=E)),
        "num_sms in combine": lambda: _with_num_sms(buf, 20 if me else 24,
                                                    lambda: buf.combine(recv_x, handle, recv_w)),
        "a cached handle on one rank only": lambda: (buf.dispatch(x, handle=handle) if me
                                                     else buf.dispatch(x, idx, w, num_experts=E)),
        "a skipped combine (the next dispatch instead)": lambda: (buf.dispatch(x, idx, w, num_experts=E) if me
                                                                   else buf.combine(recv_x, handle, recv_w)),
        "a skipped low-latency combine": lambda: (buf.low_latency_dispatch(x, idx, M, E, use_fp8=False) if me
                                                  else buf.low_latency_combine(ll_x, idx, w, ll_handle)),
    }
    out = {name: _raises(fn) for name, fn in cases.items()}
    out["usable after"] = _same(_step(buf, rank), fresh)
    return out


EXPECTED = {
    "num_experts 12 vs 24": "num_experts: the value differs",
    "low-latency cap": "num_max_dispatch_tokens_per_rank: ",
    "hidden 7168 vs 4096": "x: the hidden size differs",
    "hidden in combine": "x: the hidden size differs",
    "top-k": "topk_idx: the top-k differs",
    "weights in dispatch": "topk_weights: whether it is given differs",
    "weights in cached dispatch": "topk_weights: whether it is given differs",
    "weights in combine": "topk_weights: whether it is given differs",
    "FP8 vs BF16": "x: the dtype differs",
    "UE8M0 vs fp32 scales": "x[1]: the FP8 scale format differs",
    "use_fp8 in low_latency_dispatch": "use_fp8: ",
    "use_ue8m0": "use_ue8m0: ",
    "use_fp8 in combine": "use_fp8: ",
    "use_fp8 in low_latency_combine": "use_fp8: ",
    "num_sms in dispatch": "num_sms: the Buffer's setting differs",
    "num_sms in combine": "num_sms: the Buffer's setting differs",
    "a cached handle on one rank only": "handle: which handle differs",
    "a skipped combine (the next dispatch instead)": "call order: ",
    "a skipped low-latency combine": "call order: ",
}


@pytest.mark.parametrize("world", [2, 3])
def test_every_disagreement_raises_on_every_rank(world):
    results = run_ranks(_disagreements, world, timeout=240)
    odd = world - 1
    for name, start in EXPECTED.items():
        texts = [r[name] for r in results]
        assert all(t.startswith(start) for t in texts), (name, texts)
        assert len(set(texts)) == 1, (name, texts)  # the same text on every rank
        assert texts[0].endswith("no rank ran the call"), (name, texts[0])
    own = [r["one rank's own ValueError"] for r in results]
    assert own[odd].startswith("topk_idx: expert ids must be < num_experts=12"), own
    for r in range(odd):
        assert own[r].startswith(f"topk_idx: rank {odd} rejected dispatch call #4 on this Buffer"), own
    assert all(r["usable after"] for r in results)


def _other_argument_rejected(rank, world):
    """A rank that fails with something other than a ValueError (a TypeError of a wrong keyword) before the call's
    exchange still takes part; the next call agrees."""
    buf = _buffer()
    x, idx, w = _inputs(rank)
    try:
        if rank == 0:
            buf.dispatch(x, idx, w, num_experts=E, no_such_argument=1)
        else:
            buf.dispatch(x, idx, w, num_experts=E)
    except (TypeError, ValueError) as e:
        first = f"{type(e).__name__}: {e}"
    return first, _same(_step(buf, rank), _step(_buffer(), rank))


def test_a_rank_failing_otherwise_is_named_too():
    (t0, ok0), (t1, ok1) = run_ranks(_other_argument_rejected, 2, timeout=120)
    assert t0.startswith("TypeError") and "no_such_argument" in t0, t0
    assert t1 == ("ValueError: call: rank 0 rejected dispatch call #1 on this Buffer (see that rank's error); "
                  "no rank ran the call"), t1
    assert ok0 and ok1


def _fails_inside_the_backend(rank, world, check_calls=False):
    """A rank whose call fails inside the backend after its arguments were accepted, before the call's first
    exchange (as an allocation that runs out of memory would): the other ranks raise naming it instead of waiting
    for it, and the Buffer takes the next agreeing call everywhere."""
    import time
    failer = 1
    x, idx, w = _inputs(rank)
    out = {}
    for kind, method in (("dispatch", "dispatch"), ("cached dispatch", "dispatch"), ("combine", "combine"),
                         ("low_latency_dispatch", "low_latency_dispatch"),
                         ("low_latency_combine", "low_latency_combine")):
        buf = _buffer(timeout_s=20.0, check_calls=check_calls)
        recv_x, _, recv_w, _, handle = buf.dispatch(x, idx, w, num_experts=E)
        ll_x, _, ll_handle, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        call = {"dispatch": lambda: buf.dispatch(x, idx, w, num_experts=E),
                "cached dispatch": lambda: buf.dispatch(x, handle=handle),
                "combine": lambda: buf.combine(recv_x, handle, recv_w),
                "low_latency_dispatch": lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False),
                "low_latency_combine": lambda: buf.low_latency_combine(ll_x, idx, w, ll_handle)}[kind]
        if rank == failer:
            def failing(*args, **kwargs):
                raise RuntimeError("out of memory (simulated, inside the backend)")
            setattr(buf._backend, method, failing)
        t0 = time.monotonic()
        try:
            call()
            out[kind] = "returned"
        except (ValueError, RuntimeError) as e:
            out[kind] = f"{type(e).__name__}: {e}"
        out[kind + " seconds"] = time.monotonic() - t0
        if rank == failer:
            delattr(buf._backend, method)
        out[kind + " after"] = _same(_step(buf, rank), _step(_buffer(), rank))
        buf.destroy()
    return out


@pytest.mark.parametrize("world,check_calls", [(2, False), (3, False), (2, True)])
def test_a_call_failing_inside_the_backend_before_its_exchange_raises_everywhere(world, check_calls):
    """With check_calls on too: the store agreed on the call already, the peers wait in the backend's exchange."""
    results = run_ranks(_fails_inside_the_backend, world, check_calls, timeout=300)
    calls = {"dispatch": 3, "cached dispatch": 3, "combine": 3, "low_latency_dispatch": 3, "low_latency_combine": 3}
    for rank, out in enumerate(results):
        for kind, number in calls.items():
            op = kind.replace("cached ", "")
            if rank == 1:
                assert out[kind] == "RuntimeError: out of memory (simulated, inside the backend)", out[kind]
            else:
                assert out[kind] == (f"ValueError: call: rank 1 rejected {op} call #{number} on this Buffer "
                                     f"(see that rank's error); no rank ran the call"), (rank, kind, out[kind])
                assert out[kind + " seconds"] < 15, (rank, kind, out[kind + " seconds"])  # not the 20 s timeout
            assert out[kind + " after"], (rank, kind)


# ---- a skipped call: a timeout, then a rebuild ----------------------------------------------------------------
def _skips(rank, world):
    from deepcomm.errors import CommTimeoutError
    skipper = 1
    x, idx, w = _inputs(rank)
    out = {}
    for kind in ("first call", "dispatch", "cached dispatch", "combine", "low_latency_dispatch",
                 "low_latency_combine"):
        buf = _buffer(timeout_s=2.0)
        if kind != "first call":
            recv_x, _, recv_w, _, handle = buf.dispatch(x, idx, w, num_experts=E)
            buf.dispatch(x, handle=handle)
            ll_x, _, ll_handle, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        call = {"first call": lambda: buf.dispatch(x, idx, w, num_experts=E),
                "dispatch": lambda: buf.dispatch(x, idx, w, num_experts=E),
                "cached dispatch": lambda: buf.dispatch(x, handle=handle),
                "combine": lambda: buf.combine(recv_x, handle, recv_w),
                "low_latency_dispatch": lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False),
                "low_latency_combine": lambda: buf.low_latency_combine(ll_x, idx, w, ll_handle)}[kind]
        if rank != skipper:
            try:
                call()
                out[kind] = "no timeout"
            except CommTimeoutError as e:
                try:
                    buf.dispatch(x, idx, w, num_experts=E)
                    after = "usable"
                except RuntimeError as again:
                    after = str(again)
                out[kind] = (e.stage, after)
        dist.barrier()  # the skipper waits here until the others have timed out (the world group is apart)
        buf.destroy()
        rebuilt = _buffer(timeout_s=30.0)  # on every rank
        out[kind + " rebuilt"] = _same(_step(rebuilt, rank), _step(_buffer(), rank))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_skipped_call_times_out_and_a_rebuilt_buffer_works(world):
    results = run_ranks(_skips, world, timeout=300)
    stages = {"first call": "dispatch:counts", "dispatch": "dispatch:counts", "cached dispatch": "dispatch:agree", "combine": "combine:agree",
              "low_latency_dispatch": "low_latency_dispatch:agree", "low_latency_combine": "low_latency_combine:agree"}
    for rank, out in enumerate(results):
        for kind, stage in stages.items():
            assert out[kind + " rebuilt"], (rank, kind)
            if rank != 1:
                got_stage, after = out[kind]
                assert got_stage == stage, (rank, kind, out[kind])
                assert after.startswith("deepcomm: this Buffer had a communication timeout; destroy it and build a "
                                        "new one on every rank"), after
