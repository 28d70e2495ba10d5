"""Call agreement on the CUDA backend's kernels (deepcomm/agreement.py, csrc/runtime/agree_record.hpp), at
DEEPCOMM_TEST_WORLD ranks (one GPU each, or all on GPU 0 in shared mode): ranks that disagree about a normal fresh
dispatch (also with num_worst_tokens), a cached dispatch, a combine, a low-latency dispatch or combine, or a rank
that rejected its own input, raise ValueError on every rank with the very text the reference backend raises for
the same calls (the fresh dispatch in the call; the others at the next call or synchronize(), here
synchronize()); after each, an agreeing round of every call is bit-exact against the reference backend. Then a
randomized run: a random rank sometimes changes a random argument of a random call.

Both Buffers of a worker make the same calls in the same order, so their call numbers, and with them the texts,
are the same. The low-latency cases run once more with every peer reached by NVSHMEM puts
(DEEPCOMM_LL_FORCE_PUTS=1), whose words travel inside the blocks the host puts."""
from __future__ import annotations

import random

import pytest
import torch

from tests.agreement.test_agreement import _with_num_sms
from tests.helpers.nccl_run import (cuda_buffer, has_nvshmem_wheel, needs_ranks, rank_device, ranks_for_tests,
                                    reference, run_on_gpus, scaled)
from tests.helpers.same_bits import assert_same

pytestmark = [pytest.mark.gpu, needs_ranks(2)]

WORLD = ranks_for_tests()
T, H, E, K, M = 24, 512, 16, 4, 32  # tokens, hidden (% 128 == 0: FP8 paths), experts, top-k, low-latency cap


def _same(a, b, what):
    assert_same(a, b, what, ("the CUDA backend", "the reference backend"))



class Inputs:
    """One rank's inputs for a round, the same on both Buffers."""

    def __init__(self, gen, dev, T=T, hidden=H, k=K):
        self.x = (torch.randn(T, hidden, generator=gen) * 2).to(torch.bfloat16).to(dev)
        self.idx = torch.rand(T, E, generator=gen).topk(k, dim=1).indices.to(dev)
        self.w = torch.rand(T, k, generator=gen).to(dev)


class Side:
    """One Buffer (``label``: "cuda" or "reference") and the handles of its latest agreeing round."""

    def __init__(self, label, buf):
        self.label, self.buf = label, buf
        self.handle = self.recv_x = self.recv_w = self.ll_handle = self.ll_x = self.ll_idx = self.ll_w = None


def _round(side, inp):
    """An agreeing round of every call; returns what must be bit-exact across the backends."""
    b = side.buf
    recv_x, recv_idx, recv_w, per_expert, h = b.dispatch(inp.x, inp.idx, inp.w, num_experts=E)
    again = b.dispatch(inp.x, handle=h, topk_weights=inp.w)
    combined = b.combine(recv_x, h, recv_w)
    ll_x, ll_count, ll_h, _ = b.low_latency_dispatch(inp.x, inp.idx, M, E, use_fp8=False)
    ll_out, _ = b.low_latency_combine(ll_x, inp.idx, inp.w, ll_h)
    side.handle, side.recv_x, side.recv_w, side.ll_handle, side.ll_x = h, recv_x, recv_w, ll_h, ll_x
    side.ll_idx, side.ll_w = inp.idx, inp.w  # a low-latency combine of ll_handle takes its dispatch's topk_idx
    return {"recv_x": recv_x, "recv_topk_idx": recv_idx, "recv_topk_weights": recv_w,
            "tokens per expert": list(per_expert), "cached recv_x": again[0], "cached weights": again[2],
            "combine x": combined[0], "combine weights": combined[1], "low-latency recv_count": ll_count,
            "low-latency combine": ll_out}


def _agreeing_round(sides, inp, rank, after):
    got = {s.label: _round(s, inp) for s in sides}
    for name in got["cuda"]:
        _same(got["cuda"][name], got["reference"][name], f"rank {rank}, agreeing round after {after}: {name}")
    try:
        sides[0].buf.synchronize()
    except ValueError as e:
        raise AssertionError(f"rank {rank}: an error was left over after {after} and its agreeing round: {e}")


def _outcome(side, call):
    """The ValueError text ``call(side)`` leads to on this rank (None: none); a deferred one is raised by
    synchronize() on the CUDA backend (the reference backend raises in the call)."""
    try:
        call(side)
        side.buf.synchronize()
    except ValueError as e:
        return str(e)
    return None


def _expect_disagreement(sides, call, rank, what, deferred=False):
    ref = _outcome(sides[1], call)
    got = _outcome(sides[0], call)
    assert ref is not None, f"{what}: the reference backend raised nothing on rank {rank} (test set-up)"
    when = "by synchronize()" if deferred else "in the call"
    assert got is not None, f"{what}: the CUDA backend raised nothing on rank {rank} (expected {when}: {ref!r})"
    assert got == ref, f"{what}, rank {rank}: the CUDA backend raised {got!r}; the reference backend {ref!r}"


def _cases(rank, world, me, dev):
    """(what, call(side), deferred on the CUDA backend). ``me``: the rank that deviates."""
    odd = rank == me
    bad_w = lambda inp: inp.w.to(torch.float64) if odd else inp.w  # noqa: E731  (rejected by validation there)
    from deepcomm.fp8 import per_token_cast_to_fp8
    gen = torch.Generator().manual_seed(77 + rank)
    inp = Inputs(gen, dev)
    narrow = Inputs(gen, dev, hidden=H // 2 if odd else H)
    fewer = Inputs(gen, dev, k=K - 1 if odd else K)
    fp8 = per_token_cast_to_fp8(inp.x)
    return [
        # ---- normal fresh dispatch (raised in the call, on every rank) ----
        ("fresh dispatch, a rank rejected its topk_weights",
         lambda s: s.buf.dispatch(inp.x, inp.idx, bad_w(inp), num_experts=E), False),
        ("fresh dispatch, num_experts differs",
         lambda s: s.buf.dispatch(inp.x, inp.idx, inp.w, num_experts=2 * E if odd else E), False),
        ("fresh dispatch, hidden differs", lambda s: s.buf.dispatch(narrow.x, narrow.idx, narrow.w, num_experts=E),
         False),
        ("fresh dispatch, topk_weights on some ranks only",
         lambda s: s.buf.dispatch(inp.x, inp.idx, None if odd else inp.w, num_experts=E), False),
        ("fresh dispatch, FP8 against BF16",
         lambda s: s.buf.dispatch(fp8 if odd else inp.x, inp.idx, inp.w, num_experts=E), False),
        ("fresh dispatch, top-k differs", lambda s: s.buf.dispatch(fewer.x, fewer.idx, fewer.w, num_experts=E),
         False),
        ("fresh dispatch, num_sms differs",
         lambda s: _with_num_sms(s.buf, 6 if odd else 8, lambda: s.buf.dispatch(inp.x, inp.idx, inp.w,
                                                                                num_experts=E)), False),
        ("fresh dispatch on one rank, combine on the others",
         lambda s: s.buf.dispatch(inp.x, inp.idx, inp.w, num_experts=E) if odd
         else s.buf.combine(s.recv_x, s.handle, s.recv_w), True),
        ("fresh dispatch with num_worst_tokens, num_experts differs",
         lambda s: s.buf.dispatch(inp.x, inp.idx, inp.w, num_experts=2 * E if odd else E,
                                  num_worst_tokens=world * T), True),
        # ---- cached dispatch (deferred) ----
        ("cached dispatch, topk_weights on some ranks only",
         lambda s: s.buf.dispatch(inp.x, handle=s.handle, topk_weights=inp.w if odd else None), True),
        ("cached dispatch, a rank rejected x",
         lambda s: s.buf.dispatch(inp.x[:-1] if odd else inp.x, handle=s.handle, topk_weights=inp.w), True),
        # ---- combine (deferred) ----
        ("combine, use_fp8 differs", lambda s: s.buf.combine(s.recv_x, s.handle, s.recv_w, use_fp8=odd), True),
        ("combine, num_sms differs",
         lambda s: _with_num_sms(s.buf, 6 if odd else 8, lambda: s.buf.combine(s.recv_x, s.handle, s.recv_w)), True),
        ("combine, topk_weights on some ranks only",
         lambda s: s.buf.combine(s.recv_x, s.handle, None if odd else s.recv_w), True),
        ("combine, a rank rejected its topk_weights",
         lambda s: s.buf.combine(s.recv_x, s.handle, s.recv_w.to(torch.float64) if odd else s.recv_w), True),
        # ---- low-latency (deferred) ----
        ("low-latency dispatch, use_fp8 differs",
         lambda s: s.buf.low_latency_dispatch(inp.x, inp.idx, M, E, use_fp8=odd), True),
        ("low-latency dispatch, top-k differs",
         lambda s: s.buf.low_latency_dispatch(fewer.x, fewer.idx, M, E, use_fp8=False), True),
        ("low-latency dispatch, a rank rejected x",
         lambda s: s.buf.low_latency_dispatch(inp.x.float() if odd else inp.x, inp.idx, M, E, use_fp8=False), True),
        ("low-latency combine, use_fp8 differs",
         lambda s: s.buf.low_latency_combine(s.ll_x, s.ll_idx, s.ll_w, s.ll_handle, use_fp8=odd), True),
        ("low-latency combine, a rank rejected its topk_weights",
         lambda s: s.buf.low_latency_combine(s.ll_x, s.ll_idx, s.ll_w.double() if odd else s.ll_w, s.ll_handle),
         True),
    ]


def _first_low_latency_cases(rank, me, dev):
    """Before any low-latency call: the buffer's shape is compared as it is made (in the call, every rank)."""
    odd = rank == me
    inp = Inputs(torch.Generator().manual_seed(5 + rank), dev)
    return [
        ("first low-latency dispatch, num_max_dispatch_tokens_per_rank differs",
         lambda s: s.buf.low_latency_dispatch(inp.x, inp.idx, M // 2 if odd else M, E, use_fp8=False), False),
        ("first low-latency dispatch, a rank rejected x",
         lambda s: s.buf.low_latency_dispatch(inp.x.float() if odd else inp.x, inp.idx, M, E, use_fp8=False), False),
    ]


def _buffers(dev):
    kw = dict(max_tokens_per_rank=4 * T, hidden=H, num_max_low_latency_tokens=M, timeout_s=20)
    return [Side("cuda", cuda_buffer(num_sms=8, **kw)), Side("reference", reference(dev, **kw))]


def worker_device(rank, puts=False) -> torch.device:
    """This rank's GPU, made current; with ``puts``, every low-latency peer is reached by NVSHMEM puts
    (DEEPCOMM_LL_FORCE_PUTS=1, the low-latency buffer in NVSHMEM memory) for the Buffers made after this."""
    if puts:
        import os
        os.environ["DEEPCOMM_LL_MEMORY"] = "nvshmem"
        os.environ["DEEPCOMM_LL_FORCE_PUTS"] = "1"
    dev = rank_device(rank)
    torch.cuda.set_device(dev)
    return dev


def _cases_worker(rank, world, puts=False):
    """Every case of _cases, each followed by an agreeing round. ``puts``: the low-latency cases only, with every
    peer reached by NVSHMEM puts (their words travel inside the puts)."""
    dev = worker_device(rank, puts)
    sides = _buffers(dev)
    me = world - 1
    tag = " (puts)" if puts else ""
    for what, call, deferred in _first_low_latency_cases(rank, me, dev):
        _expect_disagreement(sides, call, rank, what + tag, deferred)
    gen = torch.Generator().manual_seed(1000 + rank)
    _agreeing_round(sides, Inputs(gen, dev), rank, "the first low-latency cases" + tag)
    if puts:
        assert sides[0].buf._backend.ll.buffer.put_peers == [p for p in range(world) if p != rank]
    for what, call, deferred in _cases(rank, world, me, dev):
        if puts and not what.startswith("low-latency"):
            continue
        _expect_disagreement(sides, call, rank, what + tag, deferred)
        _agreeing_round(sides, Inputs(gen, dev), rank, what + tag)
    for s in sides:
        s.buf.destroy()
    if puts:
        from deepcomm.cuda import nvshmem_session
        nvshmem_session.finalize()


def _random_worker(rank, world):
    """A random call of a random kind each step; half the time a random rank changes a random argument."""
    from deepcomm.fp8 import per_token_cast_to_fp8
    dev = rank_device(rank)
    torch.cuda.set_device(dev)
    sides = _buffers(dev)
    gen = torch.Generator().manual_seed(2000 + rank)
    _agreeing_round(sides, Inputs(gen, dev), rank, "the start")
    plan = random.Random(4242)  # the same plan on every rank
    for step in range(16):
        kind = plan.choice(["fresh", "cached", "combine", "ll_dispatch", "ll_combine"])
        change = plan.choice(["none", "reject", "num_experts", "hidden", "weights", "fp8"])
        if kind.startswith("ll") and change in ("num_experts", "hidden"):
            change = "none"  # a low-latency shape is compared where its buffer is made (the first cases)
        who = plan.randrange(world)
        odd = rank == who and change != "none"
        inp = Inputs(gen, dev, hidden=H // 2 if odd and change == "hidden" else H)
        w = inp.w.double() if odd and change == "reject" else inp.w
        e = 2 * E if odd and change == "num_experts" else E

        def call(s):
            b = s.buf
            if kind == "fresh":
                x = per_token_cast_to_fp8(inp.x) if odd and change == "fp8" else inp.x
                return b.dispatch(x, inp.idx, None if odd and change == "weights" else w, num_experts=e)
            if kind == "cached":
                return b.dispatch(inp.x, handle=s.handle, topk_weights=None if odd and change == "weights" else w)
            if kind == "combine":
                return b.combine(s.recv_x, s.handle, None if odd and change == "weights" else
                                 (s.recv_w.double() if odd and change == "reject" else s.recv_w),
                                 use_fp8=odd and change == "fp8")
            if kind == "ll_dispatch":
                x = inp.x.float() if odd and change == "reject" else inp.x
                return b.low_latency_dispatch(x, inp.idx, M, E, use_fp8=odd and change == "fp8")
            ll_w = s.ll_w.double() if odd and change == "reject" else s.ll_w
            return b.low_latency_combine(s.ll_x, s.ll_idx, ll_w, s.ll_handle, use_fp8=odd and change == "fp8")

        what = f"random step {step}: {kind}, rank {who} changes {change}"
        ref = _outcome(sides[1], call)  # None where the change touches nothing of this call: it agrees
        got = _outcome(sides[0], call)
        assert got == ref, f"{what}, rank {rank}: the CUDA backend gave {got!r}; the reference backend {ref!r}"
        _agreeing_round(sides, Inputs(gen, dev), rank, what)
    for s in sides:
        s.buf.destroy()


def test_each_disagreement_raises_on_every_rank_with_the_reference_text():
    run_on_gpus(_cases_worker, WORLD, timeout_s=scaled(600))


def test_random_disagreements_raise_everywhere_and_agreeing_calls_are_exact():
    run_on_gpus(_random_worker, WORLD, timeout_s=scaled(600))


@pytest.mark.skipif(not has_nvshmem_wheel(), reason="nvidia.nvshmem is not importable (pip install nvidia-nvshmem-cu13)")
def test_low_latency_disagreements_through_puts_raise_on_every_rank():
    run_on_gpus(_cases_worker, WORLD, True, timeout_s=scaled(600))
