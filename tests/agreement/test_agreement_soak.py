"""A randomized disagreement soak on the reference backend (deepcomm/agreement.py), 2 and 3 gloo processes: a seeded
plan of 60 collective calls of every kind, where a random rank sometimes changes one random argument (or rejects its
own input, or makes another call). Every disagreement raises ValueError on every rank naming the argument (the same
text on every rank but one that rejected its own call, which raises its own error); every agreeing call gives, bit
for bit, what the same call gives when only the agreeing calls are made on a fresh Buffer."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import pytest
import torch

from tests.helpers.multiproc import run_ranks

H, E, M, CAP = 256, 12, 8, 6  # CAP: the low-latency token cap of the calls (the Buffer takes up to M)
STEPS = 60

# what each kind of call can have one rank change, and the argument the ValueError then names
PERTURB = {
    "dispatch": ["num_experts", "hidden", "topk", "weights", "dtype", "reject", "order", "num_sms"],
    "cached": ["hidden", "weights", "dtype", "handle", "reject", "num_sms"],
    "combine": ["hidden", "weights", "use_fp8", "handle", "reject", "order", "num_sms"],
    "ll_dispatch": ["num_experts", "hidden", "topk", "cap", "use_fp8", "reject", "order"],
    "ll_combine": ["hidden", "use_fp8", "reject", "order"],
}
NAMED = {"num_experts": "num_experts", "hidden": "x", "topk": "topk_idx", "weights": "topk_weights", "dtype": "x",
         "handle": "handle", "cap": "num_max_dispatch_tokens_per_rank", "use_fp8": "use_fp8", "order": "call order",
         "num_sms": "num_sms"}


@dataclass
class Step:
    i: int
    kind: str
    K: int
    weights: bool
    fp8: bool                       # dispatch: an FP8 pair; combine, low-latency calls: use_fp8
    hook: List[bool]                # per rank (may differ)
    tokens: List[int]               # per rank (may differ)
    handle: Optional[int] = None    # the step whose dispatch made the handle used
    odd: Optional[int] = None       # the rank that differs, and how
    change: Optional[str] = None
    other_handle: Optional[int] = None
    expected: Dict[int, str] = field(default_factory=dict)


def make_plan(seed: int, world: int) -> List[Step]:
    rng = random.Random(seed)
    plan, handles, ll = [], [], None
    for i in range(STEPS):
        kinds = ["dispatch", "ll_dispatch"] + (["cached", "combine"] if handles else []) + (["ll_combine"] if ll
                                                                                              is not None else [])
        kind = rng.choice(kinds)
        st = Step(i, kind, K=rng.randint(1, 3), weights=rng.random() < 0.7, fp8=rng.random() < 0.4,
                  hook=[rng.random() < 0.5 for _ in range(world)], tokens=[rng.randint(0, CAP) for _ in range(world)])
        if kind in ("cached", "combine"):
            st.handle = rng.choice(handles)
        if kind == "ll_combine":
            st.handle = ll
        if rng.random() < 0.35:
            choices = [c for c in PERTURB[kind] if c != "handle" or len(handles) > 1]
            st.odd, st.change = rng.randrange(world), rng.choice(choices)
            if st.change == "handle":
                st.other_handle = rng.choice([h for h in handles if h != st.handle])
        elif kind == "dispatch":
            handles.append(i)
        elif kind == "ll_dispatch":
            ll = i
        plan.append(st)
    return plan


def _gen(seed, i, rank, salt=0):
    return torch.Generator().manual_seed(((seed * 1000 + i) * 16 + rank) * 8 + salt)


def _ids(gen, T, K, E_, mask=True):
    """[T, K] distinct expert ids per row, some slots -1 (``mask``)."""
    idx = torch.stack([torch.randperm(E_, generator=gen)[:K] for _ in range(T)]) if T else torch.zeros(
        0, K, dtype=torch.int64)
    if mask and T:
        idx[torch.rand(T, K, generator=gen) < 0.2] = -1
    return idx


def _bf16(gen, *shape):
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


def _bytes(t):
    if t is None:
        return [None]
    if isinstance(t, (tuple, list)):
        return [p for q in t for p in _bytes(q)]
    if isinstance(t, torch.Tensor):
        return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t]
    return [torch.tensor(t)]


def run_plan(buf, plan, seed, rank, world, agreeing_only):
    """Each step's ("ok", outputs as tensors) or ("error", text) on this rank."""
    from deepcomm.fp8 import per_token_cast_to_fp8
    out, made, ll_made = {}, {}, {}
    for st in plan:
        if agreeing_only and st.odd is not None:
            continue
        me = rank == st.odd
        change = st.change if me else None
        g = _gen(seed, st.i, rank)
        T, K = st.tokens[rank], st.K + (change == "topk")
        hidden = H // 2 if change == "hidden" else H
        experts = 2 * E if change == "num_experts" else E
        sms = buf.num_sms
        if change == "num_sms":
            buf.set_num_sms(sms + 2)
        try:
            kind = st.kind
            if change == "order":  # this rank makes another call
                kind = "ll_dispatch" if kind in ("dispatch", "ll_combine") else "dispatch"
            if kind == "dispatch":
                x = _bf16(g, T, hidden)
                fp8 = st.fp8 != (change == "dtype")
                idx = _ids(g, T, K, experts)
                if change == "reject" and T:
                    idx[0, 0] = experts  # out of range
                w = torch.rand(T, K, generator=g) if st.weights != (change == "weights") else None
                res = buf.dispatch(per_token_cast_to_fp8(x) if fp8 else x, idx, w, num_experts=experts,
                                   expert_alignment=0 if change == "reject" and not T else 1)
                made[st.i] = res[4]
                outputs = res[:4]
            elif kind == "cached":
                handle = made[st.other_handle if change == "handle" else st.handle]
                x = _bf16(g, handle.num_tokens, hidden)
                fp8 = st.fp8 != (change == "dtype")
                w = torch.rand(handle.num_tokens, K, generator=g) if st.weights != (change == "weights") else None
                res = buf.dispatch(per_token_cast_to_fp8(x) if fp8 else x, handle=handle, topk_weights=w,
                                   expert_alignment=0 if change == "reject" else 1)
                outputs = (res[0], res[2])
            elif kind == "combine":
                handle = made[st.other_handle if change == "handle" else st.handle]
                x = _bf16(g, handle.num_recv, hidden)
                w = torch.rand(handle.num_recv, K, generator=g) if st.weights != (change == "weights") else None
                use_fp8 = "yes" if change == "reject" else st.fp8 != (change == "use_fp8")
                outputs = buf.combine(x, handle, w, use_fp8=use_fp8)
            elif kind == "ll_dispatch":
                x = _bf16(g, T, hidden)
                use_fp8 = st.fp8 != (change == "use_fp8") and change != "reject"  # UE8M0 without FP8: rejected
                idx = _ids(g, T, K, experts)
                recv_x, count, handle, hook = buf.low_latency_dispatch(
                    x, idx, M if change == "cap" else CAP, experts, use_fp8=use_fp8,
                    use_ue8m0=change == "reject", return_recv_hook=st.hook[rank])
                hook()
                ll_made[st.i] = (handle, idx)
                outputs = (recv_x, count)
            else:  # ll_combine
                handle, idx = ll_made[st.handle]
                x = _bf16(g, E // world, world * CAP, hidden)
                w = torch.rand(*idx.shape, generator=g)
                combined, hook = buf.low_latency_combine(x, idx, w, handle, use_fp8=st.fp8 != (change == "use_fp8"),
                                                         return_recv_hook=1 if change == "reject" else st.hook[rank])
                hook()
                outputs = (combined,)
            out[st.i] = ("ok", _bytes(list(outputs)))
        except ValueError as e:
            out[st.i] = ("error", str(e))
        finally:
            if change == "num_sms":
                buf.set_num_sms(sms)
    return out


def _soak(rank, world, seed):
    import deepcomm
    plan = make_plan(seed, world)
    sizes = dict(backend="reference", hidden=H, max_tokens_per_rank=M, num_max_low_latency_tokens=M, timeout_s=30.0)
    mixed = run_plan(deepcomm.Buffer(**sizes), plan, seed, rank, world, agreeing_only=False)
    clean = run_plan(deepcomm.Buffer(**sizes), plan, seed, rank, world, agreeing_only=True)
    report = {}
    for st in plan:
        status, got = mixed[st.i]
        if st.odd is None:
            same = status == "ok" and clean[st.i][0] == "ok" and len(got) == len(clean[st.i][1]) and all(
                (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                for a, b in zip(got, clean[st.i][1]))
            report[st.i] = ("agreed", same)
        else:
            report[st.i] = ("disagreed", status, got)
    return report


@pytest.mark.parametrize("world,seed", [(2, 0), (3, 1)])
def test_random_disagreements_raise_everywhere_and_agreeing_calls_are_exact(world, seed):
    plan = make_plan(seed, world)
    reports = run_ranks(_soak, world, seed, timeout=300)
    disagreed = [st for st in plan if st.odd is not None]
    assert len(disagreed) >= 10 and len(plan) - len(disagreed) >= 20, len(disagreed)
    assert {st.change for st in disagreed} >= {"hidden", "reject", "order", "use_fp8", "num_sms"}, [
        st.change for st in disagreed]
    for st in plan:
        got = [r[st.i] for r in reports]
        if st.odd is None:
            assert all(same for _, same in got), (st, got)
            continue
        assert all(status == "error" for _, status, _ in got), (st, got)
        texts = [text for _, _, text in got]
        if st.change == "reject":
            arg = texts[st.odd].split(":", 1)[0]  # the argument its own error names
            others = [t for r, t in enumerate(texts) if r != st.odd]
            assert all(t.startswith(f"{arg}: rank {st.odd} rejected {_op(st)} call #") for t in others), (st, texts)
        else:
            assert len(set(texts)) == 1, (st, texts)
            assert texts[0].startswith(NAMED[st.change] + ": "), (st, texts[0])
        assert all(t.endswith("no rank ran the call") for r, t in enumerate(texts)
                   if not (st.change == "reject" and r == st.odd)), (st, texts)


def _op(st: Step) -> str:
    return {"dispatch": "dispatch", "cached": "dispatch", "combine": "combine", "ll_dispatch": "low_latency_dispatch",
            "ll_combine": "low_latency_combine"}[st.kind]
