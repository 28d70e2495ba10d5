"""Calls of different kinds on the internode torch routing at 2 nodes x 2 GPUs (deepcomm/internode/hier_agree.py),
on the CPU: every rank a thread (tests/helpers/threaded_world.py), whose rail rounds pair only within a rail and
whose NVLink fences only within a node, as on GPUs.

Every assignment of a fresh dispatch, a cached dispatch or a combine to the 4 ranks (not all alike) is made as
call #2 after an agreeing fresh dispatch. A dispatch takes the rail hop first, a combine the NVLink hop first.
Where that order forms a checkerboard (the two ranks of one diagonal rail-first, the other two NVLink-first) the
ranks wait in a circle and every rank's wait times out. Otherwise every rank raises the ValueError of the
difference among the words it heard (the reference text over them), naming the ranks whose words did not reach it,
if any; where no rank is in a combine every rank heard every rank and the text is the reference backend's, the
same on every rank. After that every rank has made the same rail rounds, and an agreeing fresh dispatch equals the
reference backend's bit for bit."""
from __future__ import annotations

import itertools
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
from tests.agreement.test_agree_internode_host import BUF, E, H, K, M, _inputs
from tests.helpers.same_bits import assert_same
from tests.helpers.threaded_world import NodeArea, RailTransport, ThreadComm, World, run

R, G = 4, 2
KINDS = ("fresh", "cached", "combine")
TIMED_OUT = "timed out"
MISSING = re.compile(r" \(the words of ranks? ([\d, ]+) did not reach this rank: .*\)$")


def _checkerboard(kinds) -> bool:
    """Ranks 0 = (node 0, GPU 0), 1 = (0, 1), 2 = (1, 0), 3 = (1, 1): each diagonal takes the hops in one order,
    the two diagonals in different orders."""
    rail_first = [k != "combine" for k in kinds]
    return rail_first[0] == rail_first[3] and rail_first[1] == rail_first[2] and rail_first[0] != rail_first[1]


def _worker(world: World, kinds):
    def fn(rank: int):
        rail = [r for r in range(R) if r % G == rank % G]
        tr = RailTransport(world, rank, rail_slot_bytes(M, H), rail, whole_slots=True)
        comm = HierComm(tr, NodeArea(world, rank), rank, R, G, torch.device("cpu"))
        x, idx, w = _inputs(rank, 1)
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
        rounds = tr.rounds
        x, idx, w = _inputs(rank, 3)
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


@pytest.mark.parametrize("kinds", [k for k in itertools.product(KINDS, repeat=R) if len(set(k)) > 1],
                         ids="-".join)
def test_calls_of_different_kinds_raise_on_every_rank_or_time_out(kinds):
    board = _checkerboard(kinds)
    area = R * M * max_node_row_bytes(H) + hier_agree.strip_bytes(R)
    world = World(R, G, area_bytes=area, timeout_s=1.0 if board else 120.0)
    out = run(world, _worker(world, kinds))
    if board:
        assert [o for _, o, _ in out] == [TIMED_OUT] * R
        return
    rows = [list(words) for words, _, _ in out]
    assert len({rounds for _, _, rounds in out}) == 1, f"ranks made different rail rounds: {out}"
    for rank, (_, outcome, _) in enumerate(out):
        assert outcome != "ok", f"rank {rank} ran its call"
        found = MISSING.search(outcome)
        missing = [int(s) for s in found.group(1).split(", ")] if found else []
        assert rank not in missing
        if "combine" not in kinds:  # every rank's words took both hops the same way
            assert not missing
        heard = [s for s in range(R) if s not in missing]
        want = _text(rows, heard)
        assert want.startswith("call order:") or "combine" not in kinds
        assert outcome == (want + found.group(0) if found else want), f"rank {rank}"
