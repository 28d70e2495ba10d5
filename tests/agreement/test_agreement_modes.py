"""Call agreement across the two modes and across low-latency shapes, on 2 and 3 gloo processes with the reference
backend and default settings: a normal-mode call on some ranks met by a low-latency call on the others, a rank
that changes a low-latency shape (hidden, num_experts, num_max_dispatch_tokens_per_rank) after earlier low-latency
calls, and a rank that rejects a low-latency combine of an older handle. Each raises ValueError on every rank with
the same text, naming the argument (or both calls) and each rank's value, and the Buffer's next agreeing round gives
what a fresh Buffer gives."""
from __future__ import annotations

import pytest
import torch

from tests.agreement.test_agreement import E, M, _buffer, _inputs, _raises, _same, _step
from tests.helpers.multiproc import run_ranks


def _mode_cases(rank, world):
    buf = _buffer()
    fresh = _step(_buffer(), rank)
    odd = world - 1
    me = rank == odd
    x, idx, w = _inputs(rank)
    recv_x, _, recv_w, _, handle = buf.dispatch(x, idx, w, num_experts=E)
    ll_x, _, ll_handle, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    ll_x2, _, ll_handle2, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    wide, wide_idx, _ = _inputs(rank, hidden=512 if me else 256)
    cases = {
        "fresh dispatch vs low-latency dispatch": lambda: (buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
                                                           if me else buf.dispatch(x, idx, w, num_experts=E)),
        "cached dispatch vs low-latency dispatch": lambda: (buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
                                                            if me else buf.dispatch(x, handle=handle)),
        "combine vs low-latency combine": lambda: (buf.low_latency_combine(ll_x2, idx, w, ll_handle2) if me
                                                   else buf.combine(recv_x, handle, recv_w)),
        "low-latency dispatch vs fresh dispatch": lambda: (buf.dispatch(x, idx, w, num_experts=E) if me
                                                           else buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)),
        "low-latency hidden changed on one rank": lambda: buf.low_latency_dispatch(wide, wide_idx, M, E,
                                                                                   use_fp8=False),
        "low-latency num_experts changed on one rank": lambda: buf.low_latency_dispatch(
            x, idx, M, 2 * E if me else E, use_fp8=False),
        "low-latency cap changed on one rank": lambda: buf.low_latency_dispatch(x, idx, M - 2 if me else M, E,
                                                                                use_fp8=False),
        "a rejected low-latency combine of the older handle": lambda: buf.low_latency_combine(
            ll_x, idx, w.double() if me else w, ll_handle),
    }
    out = {name: _raises(fn) for name, fn in cases.items()}
    out["usable after"] = _same(_step(buf, rank), fresh)
    return out


def _order(ops):
    return "call order: the ranks are in different calls on this Buffer (" + ops + ")"


def _expected(world):
    odd, rest = world - 1, ("rank 0" if world == 2 else "ranks 0, 1")
    # calls #1-#3 are the set-up; case i is call #3 + i
    return {
        "fresh dispatch vs low-latency dispatch": _order(f"dispatch #4 on {rest} vs low_latency_dispatch #4 on "
                                                         f"rank {odd}"),
        "cached dispatch vs low-latency dispatch": _order(f"dispatch #5 on {rest} vs low_latency_dispatch #5 on "
                                                          f"rank {odd}"),
        "combine vs low-latency combine": _order(f"combine #6 on {rest} vs low_latency_combine #6 on rank {odd}"),
        "low-latency dispatch vs fresh dispatch": _order(f"low_latency_dispatch #7 on {rest} vs dispatch #7 on "
                                                         f"rank {odd}"),
        "low-latency hidden changed on one rank": (f"x: the hidden size differs across ranks in low_latency_dispatch "
                                                   f"call #8 on this Buffer: 256 on {rest} vs 512 on rank {odd}"),
        "low-latency num_experts changed on one rank": ("num_experts: the value differs across ranks in "
                                                        f"low_latency_dispatch call #9 on this Buffer: {E} on {rest} "
                                                        f"vs {2 * E} on rank {odd}"),
        "low-latency cap changed on one rank": ("num_max_dispatch_tokens_per_rank: the value differs across ranks in "
                                                f"low_latency_dispatch call #10 on this Buffer: {M} on {rest} vs "
                                                f"{M - 2} on rank {odd}"),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_mode_and_shape_disagreements_raise_on_every_rank(world):
    results = run_ranks(_mode_cases, world, timeout=240)
    odd = world - 1
    for name, start in _expected(world).items():
        texts = [r[name] for r in results]
        assert all(t.startswith(start) for t in texts), (name, texts)
        assert len(set(texts)) == 1, (name, texts)
        assert texts[0].endswith("no rank ran the call"), (name, texts[0])
    rejected = [r["a rejected low-latency combine of the older handle"] for r in results]
    assert rejected[odd].startswith("topk_weights: "), rejected
    for r in range(odd):
        assert rejected[r] == (f"topk_weights: rank {odd} rejected low_latency_combine call #11 on this Buffer "
                               "(see that rank's error); no rank ran the call"), rejected
    assert all(r["usable after"] for r in results)
