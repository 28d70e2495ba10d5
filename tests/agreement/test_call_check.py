"""check_calls (deepcomm/call_check.py): every rank's collective calls compared before the backend runs, on CPU
processes with the reference backend. Matching calls give the same results as without the check; a call-wide
argument that differs (top-k, hidden, FP8 or not, a cached handle on one rank only), calls made in a different
order, a rank whose own validation failed, and a rank that never makes its call each end in an error on every
rank that names the cause, never a wait without end."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers.multiproc import run_ranks

H, E, M = 128, 8, 16


def _buffer(**kw):
    import deepcomm
    args = dict(backend="reference", hidden=H, max_tokens_per_rank=M, num_max_low_latency_tokens=M, timeout_s=10.0)
    args.update(kw)
    return deepcomm.Buffer(**args)


def _inputs(rank, T=5, K=2, seed=0):
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=gen)
    return x, idx, w


def _one_step(buf, rank):
    x, idx, w = _inputs(rank)
    recv_x, recv_idx, recv_w, _, handle = buf.dispatch(x, idx, w, num_experts=E)
    combined, _ = buf.combine(recv_x, handle, recv_w)
    again, _, _, _, _ = buf.dispatch(x, handle=handle)  # a cached dispatch
    ll_x, _, ll_handle, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    y = torch.randn(ll_x.shape, generator=torch.Generator().manual_seed(7 + rank)).to(torch.bfloat16)
    ll_out, _ = buf.low_latency_combine(y, idx, w, ll_handle)
    return [combined, again, ll_out]


def _matching_calls(rank, world):
    checked = _one_step(_buffer(check_calls=True), rank)
    plain = _one_step(_buffer(check_calls=False), rank)
    return all(torch.equal(a, b) for a, b in zip(checked, plain))


def test_matching_calls_pass_and_give_the_same_results():
    assert run_ranks(_matching_calls, 2, timeout=120) == [True, True]


def _expect_value_error(fn, *words):
    try:
        fn()
    except ValueError as e:
        assert all(w in str(e) for w in words), str(e)
        return str(e).split(":")[0]
    raise AssertionError(f"no ValueError; expected one naming {words}")


def _mismatches(rank, world):
    buf = _buffer(check_calls=True)
    out = []
    # top-k differs
    x, idx, w = _inputs(rank, K=2 + rank)
    out.append(_expect_value_error(lambda: buf.dispatch(x, idx, w, num_experts=E), "every rank", "dispatch"))
    # low-latency FP8 on one rank only
    x, idx, w = _inputs(rank)
    out.append(_expect_value_error(
        lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=rank == 0), "every rank", "low_latency_dispatch"))
    # calls in a different order
    if rank == 0:
        out.append(_expect_value_error(lambda: buf.dispatch(x, idx, w, num_experts=E), "call order"))
    else:
        out.append(_expect_value_error(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False), "call order"))
    # a cached handle on one rank only
    _, _, _, _, handle = buf.dispatch(x, idx, w, num_experts=E)
    if rank == 0:
        out.append(_expect_value_error(lambda: buf.dispatch(x, handle=handle), "cached_handle"))
    else:
        out.append(_expect_value_error(lambda: buf.dispatch(x, idx, w, num_experts=E), "cached_handle"))
    # rank 1's own validation fails: it raises its own error, rank 0 raises naming rank 1
    bad = idx.clone()
    if rank == 1:
        bad[0, 0] = E  # out of range
        out.append(_expect_value_error(lambda: buf.dispatch(x, bad, w, num_experts=E), "topk_idx"))
    else:
        out.append(_expect_value_error(lambda: buf.dispatch(x, bad, w, num_experts=E), "rank 1 rejected"))
    # still usable: the next matching calls go through
    out.append(len(_one_step(buf, rank)))
    return out


def test_mismatched_calls_raise_on_every_rank():
    r0, r1 = run_ranks(_mismatches, 2, timeout=120)
    assert r0[:2] == r1[:2] == ["topk", "use_fp8"], (r0, r1)
    assert r0[2] == r1[2] == "call order", (r0, r1)
    assert r0[3] == r1[3] == "cached_handle", (r0, r1)
    assert r0[4] == "rank 1 rejected its dispatch (call #6 on this Buffer)" and r1[4] == "topk_idx", (r0, r1)
    assert r0[5] == r1[5] == 3


def _one_rank_skips(rank, world):
    from deepcomm.errors import CommTimeoutError
    buf = _buffer(check_calls=True, timeout_s=2.0)
    x, idx, w = _inputs(rank)
    if rank == 1:
        return "skipped"
    with pytest.raises(CommTimeoutError) as info:
        buf.dispatch(x, idx, w, num_experts=E)
    return info.value.peer, info.value.stage


def test_a_rank_that_never_calls_is_named():
    assert run_ranks(_one_rank_skips, 2, timeout=60) == [(1, "call:dispatch"), "skipped"]


def _setting_differs(rank, world):
    try:
        _buffer(check_calls=rank == 0)
    except ValueError as e:
        dist.barrier()
        return str(e).split(":")[0]
    return "built"


def test_check_calls_must_agree_across_ranks():
    assert run_ranks(_setting_differs, 2, timeout=60) == ["check_calls", "check_calls"]


def test_environment_switch(monkeypatch):
    from deepcomm.call_check import resolve_check_calls
    monkeypatch.delenv("DEEPCOMM_CHECK_CALLS", raising=False)
    assert resolve_check_calls(None) is False
    assert resolve_check_calls(True) is True
    monkeypatch.setenv("DEEPCOMM_CHECK_CALLS", "1")
    assert resolve_check_calls(None) is True
    assert resolve_check_calls(False) is False
    monkeypatch.setenv("DEEPCOMM_CHECK_CALLS", "maybe")
    with pytest.raises(ValueError, match="DEEPCOMM_CHECK_CALLS"):
        resolve_check_calls(None)
    with pytest.raises(ValueError, match="check_calls"):
        resolve_check_calls(1)
