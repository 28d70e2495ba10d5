"""The device queue pair's poster protocol (csrc/transport/qp_poster.hpp: reserve, wait for room, encode, ring in
order, retire from CQEs) and the NIC loop (nic_serve.hpp), run by CPU threads: the same code the GPU posters and
the device NIC run, with real concurrency, on machines without a GPU. The GPU run is tests/runtime/test_device_qp.py."""
from __future__ import annotations

import random

import pytest

from deepcomm._ext import load_extension, load_selftest, selftest_error

C = load_extension()
T = getattr(C, "transport", None)
S = load_selftest()  # the test-only module: qp_traffic_on_host, qp_test_*
pytestmark = pytest.mark.skipif(S is None, reason=f"deepcomm._selftest is not available ({selftest_error()})")
STAGES = getattr(C, "WAIT_STAGES", {})  # enum WaitStage, exported by the extension
STAGE_QP_ROOM, STAGE_NIC_DOORBELL = STAGES.get("qp_room"), STAGES.get("nic_doorbell")


def _wqebbs(nbytes, inline):
    if not inline:
        return 1
    return (2 + (4 + nbytes + 15) // 16 + 3) // 4


def _run(channels, messages, slot, inline_every, log_wqebbs, start, timeout_s=20.0, nic_extra=0):
    rng = random.Random(channels * 1000 + messages)
    src = bytes(rng.getrandbits(8) for _ in range(channels * messages * slot))
    r = S.qp_traffic_on_host(channels, messages, slot, inline_every, log_wqebbs, start, src, timeout_s, nic_extra)
    sizes = [[S.qp_test_message_bytes(c, m, slot, inline_every) for m in range(messages)] for c in range(channels)]
    return src, r, sizes


def _check_delivered(src, r, sizes, slot, upto=None):
    for c, row in enumerate(sizes):
        for m, n in enumerate(row[:upto]):
            off = (c * len(row) + m) * slot
            assert r["recv"][off:off + n] == src[off:off + n], f"channel {c} message {m}: data differs"
            assert not any(r["recv"][off + n:off + slot]), f"channel {c} message {m}: bytes past {n}"


@pytest.mark.parametrize("channels, messages, slot, inline_every, log_wqebbs, start", [
    (4, 300, 500, 3, 6, 65536 - 700),    # across the 16-bit index wrap
    (3, 200, 230, 2, 5, 2**32 - 150),    # across the 32-bit wrap of the free-running counters
    (1, 400, 64, 0, 2, 0),               # one poster, a 4-WQEBB ring, no inline writes
])
def test_threads_post_through_nic_thread(channels, messages, slot, inline_every, log_wqebbs, start):
    src, r, sizes = _run(channels, messages, slot, inline_every, log_wqebbs, start)
    assert r["failed_stage"] == 0 and r["nic_error"] == 0 and r["error_cqes"] == 0, r
    _check_delivered(src, r, sizes, slot)
    assert r["counters"] == [messages] * channels
    assert r["fa_old"] == [m for _ in range(channels) for m in range(messages)], "signals out of posting order"
    total = sum(1 + _wqebbs(n, S.qp_test_is_inline(m, inline_every))
                for row in sizes for m, n in enumerate(row))
    assert total >= 8 * (1 << log_wqebbs), "the ring must wrap many times"
    end = (start + total) % 2**32
    assert (r["reserved"], r["published"], r["retired"], r["nic_consumed"]) == (end, end, end, end)
    assert r["cqes_seen"] == r["nic_cqes"] == channels * messages and r["nic_wqes"] == 2 * channels * messages
    assert r["nic_stopped"] == 1
    assert r["dbrec"] == T.dbrec_value(end)


def test_unsignaled_wqes_larger_than_the_ring_time_out_waiting_for_room():
    """A 4-WQEBB inline write (unsignaled) fills a 4-WQEBB ring: its signal can never get a slot. The poster
    times out waiting for room (qp:room) instead of hanging; every message before it arrived. The NIC, waiting for
    a doorbell that cannot come, times out after the same timeout: whichever of the two threads gets there first
    is recorded, which one depends on the scheduling of a loaded machine."""
    slot, messages = 220, 64
    sizes = [S.qp_test_message_bytes(0, m, slot, 1) for m in range(messages)]
    first_big = next(m for m, n in enumerate(sizes) if _wqebbs(n, True) == 4)
    src, r, _ = _run(1, messages, slot, 1, 2, 0, timeout_s=0.5)
    assert r["failed_stage"] in (STAGE_QP_ROOM, STAGE_NIC_DOORBELL), r["failed_stage"]
    assert r["counters"] == [first_big]
    _check_delivered(src, r, [sizes], slot, upto=first_big)


def test_nic_waiting_for_an_absent_poster_times_out():
    """The NIC is told to wait for one poster more than there are: it reports nic:doorbell after its timeout,
    once every real message was delivered and completed."""
    src, r, sizes = _run(2, 40, 100, 4, 4, 0, timeout_s=0.3, nic_extra=1)
    assert r["failed_stage"] == STAGE_NIC_DOORBELL and r["nic_stopped"] == 1
    _check_delivered(src, r, sizes, 100)
    assert r["counters"] == [40, 40] and r["cqes_seen"] == 80
