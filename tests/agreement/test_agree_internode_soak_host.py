"""A randomized disagreement soak on the internode torch routing with several GPUs per node (hier_normal.py over
HierComm, deepcomm/internode/hier_agree.py), on the CPU: every rank a thread (tests/helpers/threaded_world.py),
rail rounds paired within a rail and fences within a node, as on GPUs. A seeded plan of fresh dispatches, cached
dispatches and combines, where one random rank sometimes changes one argument, rejects its own input or makes
another kind of call. Every disagreement raises ValueError on every rank, in the call: the same text naming the
argument on every rank, the rejecting rank named by the others, "call order" for another kind of call (over the
words each rank heard). Every agreeing call equals the reference backend's bit for bit, and every rank has made
the same rail rounds at the end."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Optional

import pytest
import torch

from deepcomm import agreement
from deepcomm.fp8 import per_token_cast_to_fp8
from deepcomm.internode import hier_agree
from deepcomm.internode.hier_comm import HierComm
from deepcomm.internode.hier_normal import combine, dispatch
from deepcomm.internode.internode_rows import max_node_row_bytes, rail_slot_bytes
from deepcomm.reference import normal
from tests.helpers.same_bits import assert_same
from tests.helpers.threaded_world import NodeArea, RailTransport, ThreadComm, World, run

H, M, BUF, STEPS = 128, 16, 1, 40
PERTURB = {
    "dispatch": ["num_experts", "hidden", "topk", "weights", "dtype", "reject", "order", "num_sms"],
    "cached": ["hidden", "weights", "dtype", "handle", "reject", "order", "num_sms"],
    "combine": ["hidden", "weights", "use_fp8", "handle", "reject", "order", "num_sms"],
}
NAMED = {"num_experts": "num_experts", "hidden": "x", "topk": "topk_idx", "weights": "topk_weights", "dtype": "x",
         "handle": "handle", "use_fp8": "use_fp8", "order": "call order", "num_sms": "num_sms"}
OTHER_KIND = {"dispatch": "combine", "cached": "combine", "combine": "dispatch"}  # what "order" makes instead


@dataclass
class Step:
    call: int
    kind: str
    K: int
    weights: bool
    fp8: bool                          # dispatch: an FP8 pair; combine: use_fp8
    handle: Optional[int] = None       # the call whose fresh dispatch made the handle used
    odd: Optional[int] = None          # the rank that differs, and how
    change: Optional[str] = None
    other_handle: Optional[int] = None


def make_plan(seed: int, world: int) -> List[Step]:
    rng = random.Random(seed)
    plan, handles = [], []
    for call in range(1, STEPS + 1):
        kind = rng.choice(["dispatch"] + (["cached", "combine"] if handles else []))
        st = Step(call, kind, K=rng.randint(1, 3), weights=rng.random() < 0.7, fp8=rng.random() < 0.4)
        if kind != "dispatch":
            st.handle = rng.choice(handles)
        if rng.random() < 0.4:
            choices = [c for c in PERTURB[kind] if (c != "handle" or len(handles) > 1) and (c != "order" or handles)]
            st.odd, st.change = rng.randrange(world), rng.choice(choices)
            if st.change == "handle":
                st.other_handle = rng.choice([h for h in handles if h != st.handle])
        elif kind == "dispatch":
            handles.append(call)
        plan.append(st)
    return plan


def _worker(world: World, plan: List[Step], seed: int, E: int):
    R, G = world.world_size, world.gpus

    def fn(rank: int):
        rail = [r for r in range(R) if r % G == rank % G]
        tr = RailTransport(world, rank, rail_slot_bytes(M, 2 * H), rail, whole_slots=True)
        comm = HierComm(tr, NodeArea(world, rank), rank, R, G, torch.device("cpu"))
        ref = ThreadComm(world, rank)
        made = {}  # call -> (our handle, the reference backend's)
        outcomes = {}
        for st in plan:
            change = st.change if rank == st.odd else None
            kind = OTHER_KIND[st.kind] if change == "order" else st.kind
            gen = torch.Generator().manual_seed((seed * 1000 + st.call) * 64 + rank)
            hidden = 2 * H if change == "hidden" else H  # FP8 takes it too (whole 128-value groups)
            K = st.K + (change == "topk")
            with_w = st.weights != (change == "weights")
            fp8 = st.fp8 != (change in ("dtype", "use_fp8"))
            made_from = st.other_handle if change == "handle" else st.handle
            sms = 26 if change == "num_sms" else 24  # the Buffer's num_sms, as its words carry it
            h, ref_h = made.get(made_from, made.get(max(made, default=0), (None, None)))
            if kind == "dispatch":
                experts = 2 * E if change == "num_experts" else E
                T = int(torch.randint(0, M + 1, (1,), generator=gen))
                x = torch.randn(T, hidden, generator=gen).to(torch.bfloat16)
                idx = torch.rand(T, experts, generator=gen).topk(K, dim=1).indices
                idx[torch.rand(T, K, generator=gen) < 0.2] = -1
                w = torch.rand(T, K, generator=gen) if with_w else None
                xs = per_token_cast_to_fp8(x) if fp8 else x
                words = agreement.dispatch(st.call, BUF, xs, idx, w, experts, None, sms)
                ours = lambda: dispatch(comm, xs, idx, w, experts, None, 1, fingerprint=words)  # noqa: E731
                theirs = lambda: normal.dispatch(ref, xs, idx, w, experts, None, 1)  # noqa: E731
            elif kind == "cached":
                x = torch.randn(h.num_tokens, hidden, generator=gen).to(torch.bfloat16)
                w = torch.rand(h.num_tokens, K, generator=gen) if with_w else None
                xs = per_token_cast_to_fp8(x) if fp8 else x
                words = agreement.dispatch(st.call, BUF, xs, None, w, E, h, sms)
                ours = lambda: dispatch(comm, xs, None, w, E, h, 1, fingerprint=words)  # noqa: E731
                theirs = lambda: normal.dispatch(ref, xs, None, w, E, ref_h, 1)  # noqa: E731
            else:
                y = torch.randn(h.num_recv, hidden, generator=gen).to(torch.bfloat16)
                w = torch.rand(h.num_recv, K, generator=gen) if with_w else None
                words = agreement.combine(st.call, BUF, y, h, w, fp8, sms)
                ours = lambda: combine(comm, y, h, w, fp8, fingerprint=words)  # noqa: E731
                theirs = lambda: normal.combine(ref, y, ref_h, w, fp8, gpus_per_node=G)  # noqa: E731
            if change == "reject":
                error = ValueError("topk_idx: expert ids must be < num_experts")
                hier_agree.join_rejected(comm, agreement.rejected(
                    "combine" if kind == "combine" else "dispatch", st.call, BUF, error))
                outcomes[st.call] = "rejected: topk_idx"
                continue
            try:
                got = ours()
            except ValueError as e:
                outcomes[st.call] = str(e)
                continue
            outcomes[st.call] = "ok"
            if st.odd is None:  # every rank made this call: the reference backend's result, bit for bit
                want = theirs()
                if kind == "combine":
                    assert_same(got, want, f"rank {rank}: combine call #{st.call}")
                else:
                    assert_same(got[:4], want[:4], f"rank {rank}: {kind} call #{st.call}")
                if kind == "dispatch":
                    got[4].call = want[4].call = st.call
                    made[st.call] = (got[4], want[4])
        return outcomes, tr.rounds
    return fn


@pytest.mark.parametrize("nodes,gpus,seed", [(2, 2, 1), (3, 2, 0), (2, 4, 1)])
def test_random_disagreements_raise_everywhere_and_agreeing_calls_are_exact(nodes, gpus, seed):
    R = nodes * gpus
    E = 3 * R
    plan = make_plan(seed, R)
    area = R * M * max_node_row_bytes(2 * H) + hier_agree.strip_bytes(R)  # room for the wider rows
    world = World(R, gpus, area_bytes=area, timeout_s=120.0)
    out = run(world, _worker(world, plan, seed, E))
    assert len({rounds for _, rounds in out}) == 1, f"ranks made different rail rounds: {[r for _, r in out]}"
    disagreed = [st for st in plan if st.odd is not None]
    assert len(disagreed) >= 8 and len(plan) - len(disagreed) >= 16, len(disagreed)
    assert {"order", "reject", "num_sms"} <= {st.change for st in disagreed}, [st.change for st in disagreed]
    for st in plan:
        texts = [outcomes[st.call] for outcomes, _ in out]
        if st.odd is None:
            assert texts == ["ok"] * R, (st, texts)
            continue
        if st.change == "reject":
            assert texts[st.odd] == "rejected: topk_idx"
            others = [t for r, t in enumerate(texts) if r != st.odd]
            assert all(t.startswith(f"topk_idx: rank {st.odd} rejected ") for t in others), (st, texts)
        elif st.change == "order":
            assert all(t.startswith("call order: the ranks are in different calls on this Buffer (") for t in texts), (
                st, texts)
        else:
            assert len(set(texts)) == 1 and texts[0].startswith(NAMED[st.change] + ": "), (st, texts)
        assert all(t.endswith("no rank ran the call") or "did not reach this rank" in t
                   for r, t in enumerate(texts) if not (st.change == "reject" and r == st.odd)), (st, texts)
