"""The host side of the CUDA backend's normal mode (deepcomm/nvlink/backend.py), on the CPU with a stand-in for the
NVLink context: which steps each kind of dispatch asks of its one crossing into C++ (csrc/runtime/nvl_calls.hpp),
the stream order it passes (plain calls on the caller's stream, previous_event / async_finish on the communication
stream, CUDA-graph capture), how the output block is reserved, trimmed and released, and what comes back. The
kernels themselves are tested on GPUs (tests/normal/test_intranode.py)."""
import types

import pytest
import torch

from tests.helpers.nvl_stand_ins import C, CALLER, COMM, CAPTURE, DEFAULT, OTHER, POOL, FakeEvent, cpu_backend

pytestmark = pytest.mark.skipif(C is None, reason="needs the extension deepcomm._C (its layouts and flags)")

if C is not None:
    from deepcomm.nvlink import arena_sizing, backend as B
    from deepcomm.handle import Handle


@pytest.fixture
def env(monkeypatch):
    return cpu_backend(monkeypatch.setattr)


def _inputs(T=64, H=1024, K=4, E=8, weights=True):
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    idx = torch.zeros(T, K, dtype=torch.int64)
    return x, idx, torch.zeros(T, K) if weights else None, E


def _fresh(b, **kw):
    x, idx, w, E = _inputs()
    return b.dispatch(x, idx, w, E, None, 1, **kw)


def test_plain_fresh_dispatch_is_one_crossing_on_the_callers_stream(env):
    b, ctx = env.b, env.ctx
    recv_x, recv_idx, recv_w, per_expert, h = _fresh(b)
    (call,) = ctx.calls
    steps = B.BEGIN | B.NOTIFY | B.PAYLOAD | B.WAIT | B.FINISH
    assert call["flags"] & steps == steps and not call["flags"] & (B.WAIT_CALLER | B.CALLER_WAITS | B.BUMP)
    assert call["wait"] == call["run"] == CALLER and call["prev"] == 0 and call["end"] == 0
    assert call["out_rows"] == -1 and call["tag"] == 1 and call["src_copy"] != 0
    assert recv_x.shape == (64, 1024) and recv_x.dtype == torch.bfloat16
    assert recv_idx.shape == (64, 4) and recv_w.shape == (64, 4) and per_expert == [64] + [0] * 7
    assert isinstance(h, Handle) and h.num_recv == 64 and h.recv_src_idx.shape == (64,)
    assert h.count_matrix.shape == (1, 1) and h.send_pos.shape == (64, 1) and h.is_token_in_rank.shape == (64, 1)
    # the worst-case block (256 rows) was trimmed to the 64 rows that came
    used = C.dispatch_out_layout(64, 2048, 0, 4)["total"]
    assert b.arena.nbytes - b.arena.free_bytes() == -(-used // 256) * 256
    del recv_x, recv_idx, recv_w, h
    assert b.arena.free_bytes() == b.arena.nbytes  # the block returns when its last view dies


def test_fresh_dispatch_workspace_is_carved_by_the_exported_layout(env):
    """The one int32 workspace of a fresh dispatch: each part the kernels get and each view of the handle sits where
    C.fresh_dispatch_work puts it (FreshDispatchWork, csrc/runtime/nvl_layout.hpp), for outputs sized by the
    arrival (room for the capacity rows) and worst-case ones (room for num_worst_tokens)."""
    b, ctx = env.b, env.ctx
    for worst, rows in ((0, b._capacity_rows), (100, 100)):
        x, idx, w, E = _inputs()
        *_, h = b.dispatch(x, idx, w, E, None, 1, num_worst_tokens=worst)
        lay = C.fresh_dispatch_work(64, 1, E, rows)
        call = ctx.calls[-1]
        base = call["send_pos"] - 4 * lay["send_pos"]
        work = h.__dict__["_send_pos"].base
        assert work.data_ptr() == base and work.dtype == torch.int32
        # a waited dispatch's workspace comes from the pool (deepcomm/cuda/work_pool.py), a power of two at least
        # as large; a worst-case one is its own tensor of the exact size
        assert work.numel() == lay["total"] if worst else lay["total"] <= work.numel() < 2 * lay["total"]
        assert call["notify_out"] == base + 4 * lay["notify_out"]
        assert call["invalid"] == base + 4 * lay["bad_all"]
        assert call["src_copy"] == base + 4 * lay["src_idx"]
        assert call["in_rank"] == base + 4 * lay["in_rank"]
        assert h.count_matrix.data_ptr() == base + 4 * lay["count_matrix"]
        assert h.recv_src_idx.data_ptr() == base + 4 * lay["src_idx"]
        assert h.is_token_in_rank.data_ptr() == base + 4 * lay["in_rank"]
        assert h.send_pos.data_ptr() == base + 4 * lay["send_pos"]
    assert set(b._work_cache) == {(64, E, b._capacity_rows), (64, E, 100)}


def test_fresh_dispatch_asks_the_extension_once_per_shape(env, monkeypatch):
    """The workspace layout comes from the extension (a shifted answer moves every part) and is asked once per
    (tokens, local experts, rows): a crossing per call would cost host time."""
    asked = []

    def shifted(tokens, ranks, local_experts, rows):
        asked.append((tokens, ranks, local_experts, rows))
        lay = C.fresh_dispatch_work(tokens, ranks, local_experts, rows)
        return {k: v + 4 for k, v in lay.items()}

    monkeypatch.setattr(env.b, "C", types.SimpleNamespace(fresh_dispatch_work=shifted,
                                                        dispatch_out_layout=C.dispatch_out_layout))
    _, _, _, _, h = _fresh(env.b)
    _fresh(env.b)
    assert asked == [(64, 1, 8, env.b._capacity_rows)]
    lay = C.fresh_dispatch_work(64, 1, 8, env.b._capacity_rows)
    call = env.ctx.calls[0]
    base = h.__dict__["_send_pos"].base.data_ptr()
    assert call["send_pos"] == base + 16 and h.send_pos.data_ptr() == base + 16
    assert call["notify_out"] - base == 4 * lay["notify_out"] + 16
    assert call["in_rank"] - base == 4 * lay["in_rank"] + 16


def test_fresh_dispatch_work_parts_are_aligned_and_apart():
    """FreshDispatchWork: send_pos [T*R] | notify_out [R*R + L + 2] | src_idx [rows] | in_rank bytes [T*R], each
    part at a multiple of 16 bytes, none overlapping; count_matrix, per_expert and bad_all inside notify_out."""
    for T, R, L, rows in ((0, 1, 0, 0), (1, 1, 1, 1), (64, 8, 32, 2048), (7, 3, 5, 9), (4096, 8, 288, 32768)):
        w = C.fresh_dispatch_work(T, R, L, rows)
        parts = [(w["send_pos"], T * R), (w["notify_out"], R * R + L + 2), (w["src_idx"], rows),
                 (w["in_rank"], -(-T * R // 4))]
        assert w["send_pos"] == 0
        for (at, n), (nxt, _) in zip(parts, parts[1:] + [(w["total"], 0)]):
            assert at % 4 == 0 and at + n <= nxt, (T, R, L, rows, w)
        assert w["in_rank"] + -(-T * R // 4) == w["total"]
        assert w["count_matrix"] == w["notify_out"]
        assert w["per_expert"] == w["notify_out"] + R * R and w["bad_all"] == w["per_expert"] + L
    with pytest.raises(ValueError, match="ranks"):
        C.fresh_dispatch_work(1, 0, 1, 1)


def test_fresh_dispatch_tags_each_call_and_waits_longer_than_the_kernels(env):
    _fresh(env.b)
    _fresh(env.b)
    assert [c["tag"] for c in env.ctx.calls] == [1, 2]
    assert env.b._wait_timeout_s > env.b.config.timeout_s


def test_stream_order_of_plain_async_and_event_calls(env):
    b, ctx = env.b, env.ctx
    _fresh(b, async_finish=True)
    a = ctx.calls[-1]
    assert a["run"] == COMM and a["wait"] == CALLER and a["flags"] & B.WAIT_CALLER
    assert not a["flags"] & B.CALLER_WAITS and a["end"] == b._event_handles[b._event_i] != 0
    assert b.event is b._events[b._event_i]
    _fresh(b)  # a plain call after an async one waits for its end
    p = ctx.calls[-1]
    assert p["run"] == CALLER and p["prev"] == a["end"] and not p["flags"] & B.WAIT_CALLER
    env.stream = OTHER  # a plain call on another stream waits for the one the last call ran on
    _fresh(b)
    q = ctx.calls[-1]
    assert q["run"] == OTHER and q["wait"] == CALLER and q["flags"] & B.WAIT_CALLER
    ready = FakeEvent(555)
    kept = [_fresh(b, previous_event=ready)]  # the last call ran on this caller's stream: wait for it and the event
    e = ctx.calls[-1]
    assert e["run"] == COMM and e["prev"] == 555 and e["flags"] & B.WAIT_CALLER and e["flags"] & B.CALLER_WAITS
    kept.append(_fresh(b, previous_event=ready))  # now the event alone: no output released, last call on COMM
    assert not ctx.calls[-1]["flags"] & B.WAIT_CALLER
    kept.clear()  # outputs released since: the next call waits for the caller after all (they may still be read)
    _fresh(b, previous_event=ready)
    assert ctx.calls[-1]["flags"] & B.WAIT_CALLER


def test_reading_event_after_a_plain_call_records_on_its_stream(env):
    b = env.b
    _fresh(b)
    before = sum(e.recorded for e in b._events)
    ev = b.event
    assert ev is not None and sum(e.recorded for e in b._events) == before + 1


def test_calls_on_the_default_stream_stay_on_it(env):
    """A caller on torch's default stream (raw handle 0): a bounced dispatch's copies, the event read after a plain
    call and the communication stream's wait for the last plain call all use the default stream itself, never the
    fresh pool stream torch.cuda.ExternalStream(0) makes, which is ordered with nothing on the default stream (the
    copies would read the bounce area before the peers' rows land)."""
    b, state = env.b, env
    state.stream = DEFAULT
    full = b.arena.reserve(b.arena.free_bytes())  # every dispatch bounces
    h = _fresh(b)[4]
    x, _, w, E = _inputs()
    b.dispatch(x, None, w, E, h, 1)
    assert b.last_placement == "bounce" and b.bounced_calls == 2
    assert state.entered == [DEFAULT, DEFAULT]  # each copy-out behind its payload
    assert b.event.streams[-1] == DEFAULT
    state.stream = OTHER  # then a call on another stream: the communication stream first waits for the default one
    _fresh(b, async_finish=True)
    assert state.waited_streams == [DEFAULT] and state.entered[-1] == COMM
    recorded = [st for e in b._events for st in e.streams]
    assert POOL not in state.entered + state.waited_streams + recorded
    b.arena.release(*full)


def test_capture_waits_for_nothing_outside_it(env):
    b, ctx = env.b, env.ctx
    _fresh(b, async_finish=True)  # eager work on the communication stream
    env.stream, env.capturing = CAPTURE, True
    x, idx, w, E = _inputs()
    b.dispatch(x, idx, w, E, None, 1, num_worst_tokens=256)
    c = ctx.calls[-1]
    assert c["run"] == c["wait"] == CAPTURE and c["prev"] == 0 and not c["flags"] & B.WAIT_CALLER
    assert c["flags"] & B.REPORT_INVALID and not c["flags"] & B.WAIT and c["out_rows"] == 256
    b.dispatch(x, idx, w, E, None, 1, num_worst_tokens=256)  # captured together: same stream, no waits
    c2 = ctx.calls[-1]
    assert c2["run"] == CAPTURE and c2["prev"] == 0 and not c2["flags"] & B.WAIT_CALLER
    assert env.waited_streams == []


def test_full_arena_learns_the_size_first_then_places_rows_exactly(env):
    b, ctx = env.b, env.ctx
    worst = C.dispatch_out_layout(256, 2048, 0, 4)["total"]  # a fresh dispatch's reservation
    exact = C.dispatch_out_layout(64, 2048, 0, 4)["total"]
    kept = []
    while b.arena.free_bytes() >= worst:  # 64-row outputs kept alive fill the arena's worst-case room
        kept.append(_fresh(b))
    if b.arena.free_bytes() < exact:
        kept.pop()
    assert exact <= b.arena.free_bytes() < worst
    ctx.calls.clear()
    out = _fresh(b)
    first, second = ctx.calls
    assert first["flags"] & (B.NOTIFY | B.WAIT) and not first["flags"] & (B.PAYLOAD | B.FINISH)
    assert second["flags"] & (B.PAYLOAD | B.FINISH) and not second["flags"] & (B.NOTIFY | B.BEGIN | B.WAIT)
    assert second["out_rows"] == 64 and second["invalid"] == 0 and second["src_copy"] != 0
    assert out[0].shape == (64, 1024)
    del kept


def test_a_rank_with_no_tokens_still_gets_ids_and_weights_of_the_rows_it_receives(env):
    """An empty topk_idx / topk_weights may have a null data pointer: which outputs come back is said, not read
    from the pointers."""
    b, ctx = env.b, env.ctx
    ctx.recv = 5
    x, idx, w, E = _inputs(T=0)
    recv_x, recv_idx, recv_w, per_expert, h = b.dispatch(x, idx, w, E, None, 1)
    assert recv_x.shape == (5, 1024) and recv_idx.shape == (5, 4) and recv_w.shape == (5, 4)
    recv_x, recv_idx, recv_w, _, _ = b.dispatch(x, None, w, E, h, 1)
    assert recv_x.shape == (5, 1024) and recv_idx is None and recv_w.shape == (5, 4)


@pytest.mark.parametrize("fp8_imported", [True, False])
def test_fp8_outputs_in_the_arena_and_through_the_bounce_area(env, fp8_imported):
    """FP8 rows and their scales come back typed from the arena block (one crossing) and, with the arena full,
    from the bounce area (the kernel call without FINISH, the copies recording the end), whether this torch imports
    DLPack's float8 code or the x bytes are viewed back."""
    b, ctx = env.b, env.ctx
    if not fp8_imported:
        b.arena._viewed = {torch.float8_e4m3fn: torch.uint8}
    elif b.arena._viewed:
        pytest.skip("this torch's DLPack importer does not make float8_e4m3fn")
    T, H, K, E = 64, 1024, 4, 8
    x, s = torch.zeros(T, H, dtype=torch.float8_e4m3fn), torch.zeros(T, H // 128)
    idx, w = torch.zeros(T, K, dtype=torch.int64), torch.zeros(T, K)

    def check(out, with_idx):
        (rx, rs), ridx, rw = out[0], out[1], out[2]
        assert rx.dtype == torch.float8_e4m3fn and rx.shape == (T, H) and rs.shape == (T, H // 128)
        assert rs.dtype == torch.float32 and rw.shape == (T, K)
        assert (ridx.shape == (T, K) and ridx.dtype == torch.int64) if with_idx else ridx is None

    first = b.dispatch((x, s), idx, w, E, None, 1)
    check(first, True)
    assert ctx.calls[-1]["reserve_rows"] == b._capacity_rows
    h = first[4]
    check(b.dispatch((x, s), None, w, E, h, 1), False)
    assert ctx.calls[-1]["reserve_rows"] == T
    full = b.arena.reserve(b.arena.free_bytes())  # nothing left: the next dispatches bounce
    ctx.calls.clear()
    check(b.dispatch((x, s), idx, w, E, None, 1), True)
    sized, placed = ctx.calls
    assert sized["flags"] & B.WAIT and placed["out_block"] == b._arena_at + b.bounce_offset
    assert not placed["flags"] & B.FINISH and "reserve_rows" not in placed
    check(b.dispatch((x, s), None, w, E, h, 1), False)
    assert ctx.calls[-1]["out_block"] == b._arena_at + b.bounce_offset and b.bounced_calls == 2
    b.arena.release(*full)


def test_a_full_arena_with_copies_sends_a_fresh_dispatch_to_the_bounce_area_in_one_crossing(env):
    """DEEPCOMM_ARENA_FULL=copy: with no worst-case block free, notify, the payload (out_rows -1: the kernel carves
    the bounce area for the rows that come) and the wait for the counts go in one crossing, as with a block, and
    the rows are copied out; bad ids still raise on every rank."""
    b, ctx = env.b, env.ctx
    b._full_copies = True
    full = b.arena.reserve(b.arena.free_bytes())
    ctx.calls.clear()
    recv_x = _fresh(b)[0]
    (call,) = ctx.calls
    assert call["out_block"] == b._arena_at + b.bounce_offset and call["out_rows"] == -1
    assert call["flags"] & B.NOTIFY and call["flags"] & B.PAYLOAD and call["flags"] & B.WAIT
    assert call["src_copy"] != 0 and "reserve_rows" not in call
    assert recv_x.shape == (64, 1024) and b.last_placement == "bounce" and b.bounced_calls == 1
    ctx.status, ctx.bad_mine = 2, 3
    with pytest.raises(ValueError, match="topk_idx: 3 expert ids outside"):
        _fresh(b)
    ctx.status = 0
    b.arena.release(*full)


def test_the_first_dispatch_through_the_bounce_area_says_so_once(env, caplog):
    import logging
    b = env.b
    full = b.arena.reserve(b.arena.free_bytes())
    with caplog.at_level(logging.WARNING, logger="deepcomm"):
        _fresh(b)
        _fresh(b)
    said = [r.getMessage() for r in caplog.records if r.name == "deepcomm"]
    assert len(said) == 1 and b.bounced_calls == 2, said
    assert "rank 0: this Buffer's dispatch output arena is full" in said[0] and "DEEPCOMM_ARENA_OUTPUTS" in said[0]
    assert f"than its {arena_sizing.arena_outputs()} worst-case ones" in said[0]
    b.arena.release(*full)


def test_the_arena_full_way_comes_from_the_environment(monkeypatch):
    from deepcomm.config import resolve_arena_full
    monkeypatch.delenv("DEEPCOMM_ARENA_FULL", raising=False)
    assert resolve_arena_full() == "place"
    monkeypatch.setenv("DEEPCOMM_ARENA_FULL", " Copy ")
    assert resolve_arena_full() == "copy"
    monkeypatch.setenv("DEEPCOMM_ARENA_FULL", "bounce")
    with pytest.raises(ValueError, match="DEEPCOMM_ARENA_FULL: expected one of place, copy"):
        resolve_arena_full()


def test_bad_ids_raise_on_every_rank_and_give_the_block_back(env):
    b, ctx = env.b, env.ctx
    ctx.status, ctx.bad_mine = 2, 3
    with pytest.raises(ValueError, match="topk_idx: 3 expert ids outside"):
        _fresh(b)
    ctx.bad_mine = 0
    with pytest.raises(ValueError, match="topk_idx: another rank passed expert ids"):
        _fresh(b)
    assert b.arena.free_bytes() == b.arena.nbytes
    ctx.status = 0
    assert _fresh(b)[0].shape == (64, 1024)  # usable afterwards


def test_counts_that_never_come_raise_a_timeout_and_break_the_buffer(env):
    from deepcomm.errors import CommTimeoutError
    env.ctx.status = 1
    with pytest.raises(CommTimeoutError, match="notify:counts"):
        _fresh(env.b)
    assert env.b.nvl.broken


def test_cached_dispatch_bumps_the_call_number_and_places_the_known_rows(env):
    b, ctx = env.b, env.ctx
    x, idx, w, E = _inputs()
    h = b.dispatch(x, idx, w, E, None, 1)[4]
    recv_x, recv_idx, recv_w, per_expert, h2 = b.dispatch(x, None, w, E, h, 1)
    c = ctx.calls[-1]
    assert c["flags"] & (B.BUMP | B.PAYLOAD) and not c["flags"] & (B.NOTIFY | B.WAIT)
    assert c["out_rows"] == h.num_recv and c["src_copy"] == 0 and c["tag"] == 0
    assert h2 is h and recv_idx is None and recv_x.shape == (64, 1024) and per_expert == h.num_recv_tokens_per_expert


def test_combine_takes_the_same_stream_order(env):
    b, ctx = env.b, env.ctx
    x, idx, w, E = _inputs()
    h = b.dispatch(x, idx, w, E, None, 1)[4]
    out, out_w = b.combine(torch.zeros(64, 1024, dtype=torch.bfloat16), h, torch.zeros(64, 4))
    (c,) = ctx.combines
    assert c["run"] == c["wait"] == CALLER and c["end"] == 0 and out.shape == (64, 1024) and out_w.shape == (64, 4)
    b.combine(torch.zeros(64, 1024, dtype=torch.bfloat16), h, None, async_finish=True)
    assert ctx.combines[-1]["run"] == COMM and not ctx.combines[-1]["flags"] & B.CALLER_WAITS


class _TorchOps:
    """Counts the torch operators (aten) run inside it: on a GPU each one costs microseconds of host time."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                outer.ops.append(str(func.overloadpacket))
                return func(*args, **(kwargs or {}))

        self.ops, self.mode = [], Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def test_plain_calls_run_at_most_one_torch_operator(env):
    """A plain fresh dispatch allocates its workspace, a combine its output, and nothing else is a torch operator:
    the outputs are DLPack views of the arena, the rest is the one crossing (each operator costs host time)."""
    b = env.b
    x, idx, w, E = _inputs()
    *_, h = b.dispatch(x, idx, w, E, None, 1)
    for name, call, most in (("fresh", lambda: b.dispatch(x, idx, w, E, None, 1), ["aten.empty"]),
                             ("cached", lambda: b.dispatch(x, None, w, E, h, 1), []),
                             ("combine", lambda: b.combine(x, h, None), ["aten.empty"])):
        with _TorchOps() as counted:
            out = call()
        del out
        assert counted.ops == most, f"{name}: {counted.ops}"


def test_joined_calls_count_each_crossing_before_it_is_made(env, monkeypatch):
    """Capabilities.counts_joined_calls: an error before a call's first crossing leaves joined_calls unchanged (the
    Buffer then rejects the call for the other ranks); one from inside the crossing, which may come after the
    launch, counts as joined (nothing is rejected twice)."""
    b, ctx = env.b, env.ctx
    assert B.CudaBackend.capabilities.counts_joined_calls
    x, idx, w, E = _inputs()
    before = b.joined_calls
    h = b.dispatch(x, idx, w, E, None, 1)[4]
    assert b.joined_calls == before + 1
    b.combine(torch.zeros(64, 1024, dtype=torch.bfloat16), h, None)
    assert b.joined_calls == before + 2

    def no_memory(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")
    with monkeypatch.context() as m:
        m.setattr(B.torch, "empty", no_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            b.dispatch(x, idx, w, E, None, 1)
        with pytest.raises(RuntimeError, match="out of memory"):
            b.combine(torch.zeros(64, 1024, dtype=torch.bfloat16), h, None)
    assert b.joined_calls == before + 2
    assert not b.nvl.broken  # an error before the crossing: the Buffer rejects the call and goes on
    with monkeypatch.context() as m:
        m.setattr(ctx, "dispatch_into", no_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            b.dispatch(x, None, None, E, h, 1)
    assert b.joined_calls == before + 3


@pytest.mark.parametrize("call", ["dispatch", "cached dispatch", "combine"])
def test_an_error_inside_the_crossing_breaks_the_buffer_saying_why(env, monkeypatch, call):
    """A crossing that raises (a failed launch, after the call's first exchange may have begun) leaves the peers
    waiting for this rank: the Buffer takes no more calls, and its next one says why instead of meeting theirs out
    of step."""
    from deepcomm.cuda.error_record import DeviceErrorRecord
    b, ctx = env.b, env.ctx
    x, idx, w, E = _inputs()
    h = b.dispatch(x, idx, w, E, None, 1)[4]

    def launch_fails(*args, **kwargs):
        raise RuntimeError("CUDA error: too many resources requested for launch (simulated)")
    name = "combine_call" if call == "combine" else "dispatch_into"
    with monkeypatch.context() as m:
        m.setattr(ctx, name, launch_fails)
        with pytest.raises(RuntimeError, match="too many resources"):
            if call == "combine":
                b.combine(torch.zeros(64, 1024, dtype=torch.bfloat16), h, None)
            else:
                b.dispatch(x, idx if call == "dispatch" else None, w, E, None if call == "dispatch" else h, 1)
    assert b.nvl.broken and b.nvl.broken_peer is None
    assert f"this Buffer's {call} failed inside its crossing" in b.nvl.broken_reason
    assert "RuntimeError: CUDA error: too many resources" in b.nvl.broken_reason
    # the record's look at the start of every later call raises that reason (DeviceErrorRecord.check_error)
    record = DeviceErrorRecord.__new__(DeviceErrorRecord)
    record.broken, record.broken_peer, record.broken_reason = b.nvl.broken, None, b.nvl.broken_reason
    with pytest.raises(RuntimeError, match="destroy this Buffer and build a new one on every rank"):
        record.check_error()
    record.broken_reason = None  # a timeout's break keeps its own text
    with pytest.raises(RuntimeError, match="had a communication timeout"):
        record.check_error()
