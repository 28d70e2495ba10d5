"""Calls of different kinds on the internode torch routing with several GPUs per node (deepcomm/internode/
hier_agree.py), on the CPU: every rank a thread (tests/helpers/threaded_world.py), whose rail rounds pair only within
a rail and whose NVLink fences only within a node, as on GPUs.

Ranks make a fresh dispatch, a cached dispatch or a combine as call #2 after an agreeing fresh dispatch: every
assignment at 2 nodes x 2 GPUs (not all alike), and seeded random ones at 3 x 2 and 2 x 4. A dispatch takes the
rail hop first, a combine the NVLink hop first: a rail-first rank waits for its rail peers that take the NVLink
hop first, and those for their node peers that take the rail first. Where that wait forms a circle (at 2 x 2 a
checkerboard: ranks 0 and 3 one order, 1 and 2 the other) the ranks in it time out, and no rank runs its call.
Otherwise every rank raises the ValueError of the difference among the words it heard (the reference text over
them), naming the ranks whose words did not reach it, if any; where no rank is in a combine every rank heard every
rank and the text is the reference backend's, the same on every rank. After that every rank has made the same rail
rounds, and an agreeing fresh dispatch equals the reference backend's bit for bit."""
from __future__ import annotations

import itertools
import random
import re
import threading

import pytest
import torch

from deepcomm import agreement
from deepcomm.internode import hier_agree
from deepcomm.internode.hier_comm import HierComm
from deepcomm.internode.hier_normal import combine, dispatch
from deepcomm.internode.internode_rows import max_node_row_bytes, rail_slot_bytes
from deepcomm.reference import normal
from tests.agreement.test_agree_internode_host import BUF, H, K, M
from tests.helpers.same_bits import assert_same
from tests.helpers.threaded_world import NodeArea, RailTransport, ThreadComm, World, run

KINDS = ("fresh", "cached", "combine")
TIMED_OUT = "timed out"
MISSING = re.compile(r" \(the words of ranks? ([\d, ]+) did not reach this rank: .*\)$")


def _inputs(rank: int, seed: int, E: int):
    gen = torch.Generator().manual_seed(100 * seed + rank)
    T = 5 + 3 * rank
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    idx[torch.rand(T, K, generator=gen) < 0.2] = -1
    return torch.randn(T, H, generator=gen).to(torch.bfloat16), idx.contiguous(), torch.rand(T, K, generator=gen)


def _circular(kinds, gpus: int) -> bool:
    """Whether the first exchanges wait in a circle: rank r = (node r // gpus, GPU r % gpus); a rail-first rank
    waits for its NVLink-first rail peers, an NVLink-first rank for its rail-first node peers."""
    R = len(kinds)
    rail_first = [k != "combine" for k in kinds]
    waits = {r: [s for s in range(R) if s != r and rail_first[r] != rail_first[s]
                 and (s % gpus == r % gpus if rail_first[r] else s // gpus == r // gpus)] for r in range(R)}
    state = dict.fromkeys(range(R), 0)  # 0 new, 1 on the path, 2 done

    def cycle_from(r) -> bool:
        state[r] = 1
        for s in waits[r]:
            if state[s] == 1 or (state[s] == 0 and cycle_from(s)):
                return True
        state[r] = 2
        return False
    return any(state[r] == 0 and cycle_from(r) for r in range(R))


def _worker(world: World, kinds, circular: bool):
    R, G = world.world_size, world.gpus
    E = 3 * R

    def fn(rank: int):
        rail = [r for r in range(R) if r % G == rank % G]
        tr = RailTransport(world, rank, rail_slot_bytes(M, H), rail, whole_slots=True)
        comm = HierComm(tr, NodeArea(world, rank), rank, R, G, torch.device("cpu"))
        x, idx, w = _inputs(rank, 1, E)
        words = agreement.dispatch(1, BUF, x, idx, w, E, None)
        h1 = dispatch(comm, x, idx, w, E, None, 1, fingerprint=words)[4]
        h1.call = 1
        y = torch.randn(h1.num_recv, H).to(torch.bfloat16)
        yw = torch.rand(h1.num_recv, K)
        kind = kinds[rank]
        if kind == "fresh":
            words = agreement.dispatch(2, BUF, x, idx, w, E, None)
            call = lambda: dispatch(comm, x, idx, w, E, None, 1, fingerprint=words)  # noqa: E731
        elif kind == "cached":
            words = agreement.dispatch(2, BUF, x, None, w, E, h1)
            call = lambda: dispatch(comm, x, None, w, E, h1, 1, fingerprint=words)  # noqa: E731
        else:
            words = agreement.combine(2, BUF, y, h1, yw, False)
            call = lambda: combine(comm, y, h1, yw, False, fingerprint=words)  # noqa: E731
        try:
            call()
            outcome = "ok"
        except ValueError as e:
            outcome = str(e)
        except threading.BrokenBarrierError:
            return words, TIMED_OUT, None
        if circular:  # the others' Buffers must be rebuilt: no further call
            return words, outcome, None
        rounds = tr.rounds
        x, idx, w = _inputs(rank, 3, E)
        words3 = agreement.dispatch(3, BUF, x, idx, w, E, None)
        got = dispatch(comm, x, idx, w, E, None, 1, fingerprint=words3)
        assert_same(got[:4], normal.dispatch(ThreadComm(world, rank), x, idx, w, E, None, 1)[:4],
                    f"rank {rank}: the agreeing call after {kinds}")
        return words, outcome, rounds
    return fn


def _text(rows, ranks) -> str:
    with pytest.raises(ValueError) as e:
        agreement.check([rows[s] for s in ranks], ranks)
    return str(e.value)


def _check(kinds, gpus: int) -> bool:
    """Run call #2 with ``kinds`` and check every rank's outcome; whether the ranks waited in a circle."""
    R = len(kinds)
    circular = _circular(kinds, gpus)
    area = R * M * max_node_row_bytes(H) + hier_agree.strip_bytes(R)
    world = World(R, gpus, area_bytes=area, timeout_s=1.0 if circular else 120.0)
    out = run(world, _worker(world, kinds, circular))
    outcomes = [o for _, o, _ in out]
    assert "ok" not in outcomes, f"{kinds}: a rank ran its call: {outcomes}"
    if circular:
        assert TIMED_OUT in outcomes, outcomes
        return True
    rows = [list(words) for words, _, _ in out]
    assert len({rounds for _, _, rounds in out}) == 1, f"ranks made different rail rounds: {out}"
    for rank, outcome in enumerate(outcomes):
        found = MISSING.search(outcome)
        missing = [int(s) for s in found.group(1).split(", ")] if found else []
        assert rank not in missing
        if "combine" not in kinds:  # every rank's words took both hops the same way
            assert not missing
        want = _text(rows, [s for s in range(R) if s not in missing])
        assert want.startswith("call order:") or "combine" not in kinds
        assert outcome == (want + found.group(0) if found else want), f"{kinds}, rank {rank}"
    return False


@pytest.mark.parametrize("kinds", [k for k in itertools.product(KINDS, repeat=4) if len(set(k)) > 1],
                         ids="-".join)
def test_calls_of_different_kinds_at_2x2_raise_on_every_rank_or_time_out(kinds):
    checkerboard = (kinds[0] != "combine") == (kinds[3] != "combine") != (kinds[1] != "combine") == (
        kinds[2] != "combine")
    assert _check(kinds, 2) == checkerboard


@pytest.mark.parametrize("nodes,gpus,seed", [(3, 2, 0), (2, 4, 1)])
def test_random_calls_of_different_kinds_raise_on_every_rank_or_time_out(nodes, gpus, seed):
    rng = random.Random(seed)
    made = [_check(kinds, gpus) for kinds in (tuple(rng.choice(KINDS) for _ in range(nodes * gpus))
                                              for _ in range(24)) if len(set(kinds)) > 1]
    assert made.count(True) >= 3 and made.count(False) >= 12, made  # both outcomes seen
