"""The failure board (deepcomm/failure_board.py): a rank whose call broke its Buffer inside the crossing says why in
the process group's store, and the other ranks' timeouts name it. On its own over a HashStore, then through Buffers
of 2 and 3 gloo processes on the reference backend, where one rank's dispatch fails after its first exchange began
(simulated: the backend marked broken as a failed launch marks the CUDA backends)."""
import time

import pytest
import torch.distributed as dist

from deepcomm.errors import CommTimeoutError
from deepcomm.failure_board import FailureBoard
from tests.helpers.multiproc import run_ranks


def _boards(world=3):
    store = dist.HashStore()
    return [FailureBoard(store, list(range(world)), 4, r) for r in range(world)]


def test_nothing_posted_leaves_a_timeout_as_it_is():
    a, _, _ = _boards()
    assert a.reports() == {} and a.explain(CommTimeoutError(0, 1, "dispatch:counts", "waited 3 s")) is None


def test_a_timeout_names_what_the_peers_posted_the_awaited_peer_first():
    a, b, c = _boards()
    c.post("rank c's reason")
    b.post("rank b's reason")
    b.post("a second reason is not posted")
    assert a.reports() == {1: "rank b's reason", 2: "rank c's reason"} and b.reports() == {2: "rank c's reason"}
    err = a.explain(CommTimeoutError(0, 2, "combine:payload", "call #7"))
    assert (err.rank, err.peer, err.stage) == (0, 2, "combine:payload")
    assert err.detail == "call #7; rank 2 reported: rank c's reason; rank 1 reported: rank b's reason"
    assert "rank 0 timed out waiting for peer 2 at stage 'combine:payload'" in str(err)
    err = a.explain(CommTimeoutError(0, None, "dispatch:counts"))
    assert err.detail == "rank 1 reported: rank b's reason; rank 2 reported: rank c's reason"


def test_boards_of_other_buffers_do_not_mix():
    store = dist.HashStore()
    FailureBoard(store, [0, 1], 1, 1).post("an earlier Buffer broke")
    assert FailureBoard(store, [0, 1], 2, 0).reports() == {}
    assert FailureBoard(store, [0, 1], 1, 0).reports() == {1: "an earlier Buffer broke"}


class _Unreachable:
    def set(self, *a):
        raise RuntimeError("store gone")

    check = get = set


def test_an_unreachable_store_adds_nothing_and_raises_nothing():
    board = FailureBoard(_Unreachable(), [0, 1], 0, 0)
    board.post("reason")
    assert board.reports() == {} and board.explain(CommTimeoutError(0, 1, "s")) is None


REASON = "deepcomm: this Buffer's dispatch failed inside its crossing (RuntimeError: simulated launch failure)"


def _one_rank_breaks(rank, world):
    import torch
    import deepcomm
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=64, backend="reference", timeout_s=3)
    x = torch.randn(8, 64)
    idx = torch.randint(-1, 4 * world, (8, 2))
    buf.dispatch(x, topk_idx=idx, num_experts=4 * world)  # an agreeing call first
    if rank == 1:
        b = buf._backend

        def failing_dispatch(*args, **kwargs):
            b.comm.joined += 1  # its first exchange had begun: the peers are in it
            b.broken_reason = REASON
            raise RuntimeError("simulated launch failure")
        b.dispatch = failing_dispatch
    try:
        buf.dispatch(x, topk_idx=idx, num_experts=4 * world)
    except CommTimeoutError as e:
        return ("timeout", e.peer, str(e), type(e.__cause__).__name__)
    except RuntimeError as e:
        time.sleep(8)  # stay in the group while the others time out (an exit closes its connections)
        return ("error", None, str(e), None)
    return ("returned", None, "", None)


@pytest.mark.parametrize("world", [2, 3])
def test_the_other_ranks_timeouts_name_the_rank_that_broke(world):
    outs = run_ranks(_one_rank_breaks, world, timeout=120)
    assert outs[1] == ("error", None, "simulated launch failure", None), outs
    for rank in (0, 2)[:world - 1]:
        kind, _, text, cause = outs[rank]
        assert kind == "timeout" and cause == "CommTimeoutError", outs
        assert f"rank {rank} timed out" in text and f"rank 1 reported: {REASON}" in text, outs


def _timeouts_after_a_post(rank, world):
    """Rank 1 posts a reason; rank 0's synchronize() and low-latency receive hooks then time out (simulated) and
    must name it. Returns rank 0's messages."""
    import torch
    import deepcomm
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=128, backend="reference", timeout_s=3)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        buf._failures.post("rank 1's reason")
        store.set("posted", "1")
    store.wait(["posted"])
    out = []
    if rank == 0:
        b = buf._backend

        def timing_out():
            raise CommTimeoutError(0, 1, "low_latency_dispatch:data", "waited 3 s")
        b.synchronize = timing_out
        b.low_latency_dispatch = lambda *a, **k: (None, None, deepcomm.LowLatencyHandle(*([None] * 7)), timing_out)
        b.low_latency_combine = lambda *a, **k: (None, timing_out)
        x, idx = torch.randn(4, 128).to(torch.bfloat16), torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
        hooks = [buf.low_latency_dispatch(x, idx, 16, 8, use_fp8=False, return_recv_hook=True)[3]]
        hooks.append(buf.low_latency_combine(torch.randn(4, 32, 128).to(torch.bfloat16), idx, torch.rand(4, 2),
                                             _ll_handle(buf), return_recv_hook=True)[1])
        for fn in [buf.synchronize] + hooks:
            try:
                fn()
            except CommTimeoutError as e:
                out.append(str(e))
    store.set(f"done{rank}", "1")
    store.wait(["done0", "done1"])
    return out


def _ll_handle(buf):
    import torch
    from deepcomm.handle import LowLatencyHandle
    return LowLatencyHandle(src_info=torch.zeros(4, 32, dtype=torch.int32),
                            layout=torch.zeros(4, 2, 2, dtype=torch.int32), recv_pos=torch.zeros(4, 2, dtype=torch.int32),
                            num_experts=8, num_max_dispatch_tokens_per_rank=16, hidden=128, buffer_id=buf.buffer_id)


def test_synchronize_and_receive_hooks_name_what_the_peers_posted():
    outs = run_ranks(_timeouts_after_a_post, 2, timeout=120)
    assert len(outs[0]) == 3 and outs[1] == [], outs
    for text in outs[0]:
        assert "waited 3 s; rank 1 reported: rank 1's reason" in text, outs


def test_a_timed_out_rank_waits_briefly_for_the_awaited_peer_to_post():
    a, b, _ = _boards()
    err = CommTimeoutError(0, 1, "dispatch:counts", "waited 3 s")
    t0 = time.monotonic()
    assert a.explain(err, grace_s=0.3) is None and 0.25 < time.monotonic() - t0 < 2.0  # bounded by the grace
    b.post("deepcomm: rank 1 timed out waiting for peer 0 at stage 'combine:agree'")
    t0 = time.monotonic()
    told = a.explain(err, grace_s=30.0)  # posted already: no wait
    assert time.monotonic() - t0 < 1.0
    assert told.detail == "waited 3 s; rank 1 reported: deepcomm: rank 1 timed out waiting for peer 0 at stage " \
                          "'combine:agree'"


def _calls_that_differ_time_out(rank, world):
    """Every rank's call times out (simulated: the backend raises the CommTimeoutError a device wait would), each in
    a call of another kind, the later ones up to a second after rank 0: each rank's timeout must name the stage
    the others gave up at."""
    import deepcomm
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=64, backend="reference", timeout_s=3)
    stages = ["dispatch:counts", "combine:agree", "low_latency_dispatch:data"]
    b = buf._backend

    def timing_out(*args, **kwargs):
        time.sleep(0.5 * rank)
        raise CommTimeoutError(rank, (rank + 1) % world, stages[rank], "waited 3 s")
    b.synchronize = timing_out
    try:
        buf.synchronize()
    except CommTimeoutError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_in_different_calls_name_each_others_stages(world):
    stages = ["dispatch:counts", "combine:agree", "low_latency_dispatch:data"]
    outs = run_ranks(_calls_that_differ_time_out, world, timeout=120)
    for rank, text in enumerate(outs):
        peer = (rank + 1) % world
        assert text.startswith(f"deepcomm: rank {rank} timed out waiting for peer {peer} at stage '{stages[rank]}'")
        assert (f"rank {peer} reported: deepcomm: rank {peer} timed out waiting for peer {(peer + 1) % world} at "
                f"stage '{stages[peer]}'") in text, outs
