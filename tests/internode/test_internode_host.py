"""The internode exchange round's protocol (csrc/kernels/internode_round.hpp: credit, block as RDMA writes or one
inline write, signal, quiet) on CPU threads: two ranks, each with a queue pair to the other and a NIC thread
running nic_serve, the same poster code the GPU kernel runs. About a second."""
from __future__ import annotations

import random

import pytest

from deepcomm._ext import load_extension, load_selftest, selftest_error

C = load_extension()
S = load_selftest()  # the test-only module: internode_rounds_on_host, internode_test_byte
pytestmark = pytest.mark.skipif(S is None, reason=f"deepcomm._selftest is not available ({selftest_error()})")

INLINE_MAX = 220
STAGES = getattr(C, "WAIT_STAGES", {})  # enum WaitStage, exported by the extension
STAGE_CREDIT, STAGE_NIC_DOORBELL = STAGES.get("internode_credit"), STAGES.get("nic_doorbell")


def _wqes(sizes, chunk):
    """WQEs a rank posts: per round a credit and a signal fetch-add, plus one inline write for a block of
    1..220 bytes, else one write per started chunk."""
    n = 0
    for b in sizes:
        n += 2 + (1 if 0 < b <= INLINE_MAX else -(-b // chunk))
    return n


def test_rounds_deliver_every_block_in_order_with_flow_control():
    rng = random.Random(11)
    rounds, chunk = 40, 4096
    special = [16, 0, INLINE_MAX, INLINE_MAX + 1, 1, 100_000, 0, 4096, 4097]
    sizes = [special + [rng.randrange(0, 20_000) for _ in range(rounds - len(special))],
             [rng.randrange(0, 30_000) for _ in range(rounds)]]
    sizes[1][5] = 0
    # a 16-WQEBB ring: a 100 kB block is 25 write WQEs, so posters wait for completions mid-round
    r = S.internode_rounds_on_host(sizes, chunk, 4, 20.0)
    assert r["failed_stage"] == 0
    for k, d in enumerate(r["ranks"]):
        assert d["mismatched_rounds"] == 0 and d["rounds_done"] == rounds
        assert d["credit"] == d["signal"] == rounds  # one credit and one signal per round from the peer
        assert d["fa_old"] == [rounds - 1, rounds - 1]  # the last round's fetch-adds saw the previous round's counts
        wqes = _wqes(sizes[k], chunk)
        assert d["nic_wqes"] == d["nic_cqes"] == d["cqes_seen"] == wqes, (k, d, wqes)
        assert d["reserved"] == d["published"] == d["retired"] == d["nic_consumed"]
        assert d["error_cqes"] == 0 and d["nic_error"] == 0 and d["nic_stopped"] == 1


def test_a_peer_that_stops_early_gives_a_bounded_credit_wait():
    sizes = [[64, 300, 64], [64, 300]]  # rank 1 never runs round 3
    r = S.internode_rounds_on_host(sizes, 4096, 6, 0.5)
    # rank 0 waits for rank 1's credit (its NIC may give up first, waiting for a post that never comes)
    assert r["failed_stage"] in (STAGE_CREDIT, STAGE_NIC_DOORBELL)
    assert [d["rounds_done"] for d in r["ranks"]] == [2, 2]
    assert [d["mismatched_rounds"] for d in r["ranks"]] == [0, 0]


def test_test_pattern_differs_between_rounds_and_ranks():
    a = [S.internode_test_byte(0, 1, i) for i in range(512)]
    assert a != [S.internode_test_byte(0, 2, i) for i in range(512)]
    assert a != [S.internode_test_byte(1, 1, i) for i in range(512)]
