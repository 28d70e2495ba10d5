"""The host side of call agreement on the CUDA backend, on the CPU: the words each call hands to its crossing into
C++, how a disagreement the kernels found becomes the ValueError (the same text as the reference backend's, through
deepcomm/agreement.py), in the call itself for a fresh dispatch and at the next look at the error record for the
others, and the reject path of normal and low-latency calls. The kernels' side is tested on GPUs
(tests/agreement/test_agreement_gpu.py)."""
import types

import pytest
import torch

from deepcomm import agreement
from deepcomm.cuda import agree_record
from deepcomm.cuda.error_record import DeviceErrorRecord

from tests.normal.test_cuda_host_path import C, CALLER, _fresh, _inputs, env  # noqa: F401  (env is a fixture)

W = agreement.Word


def _dispatch_words(call=3, hidden=1024, num_experts=8, weights=True, dtype=torch.bfloat16, num_sms=24):
    x = torch.zeros(4, hidden, dtype=dtype)
    idx = torch.zeros(4, 2, dtype=torch.int64)
    return agreement.dispatch(call, 1, x, idx, torch.zeros(4, 2) if weights else None, num_experts, None, num_sms)


def _expected(rows):
    with pytest.raises(ValueError) as e:
        agreement.check(rows)
    return str(e.value)


# ---- the message ----------------------------------------------------------------------------------------
CASES = {
    "num_experts": [_dispatch_words(num_experts=12), _dispatch_words(num_experts=24)],
    "hidden": [_dispatch_words(hidden=7168), _dispatch_words(hidden=4096)],
    "weights on one rank only": [_dispatch_words(), _dispatch_words(weights=False)],
    "call order": [_dispatch_words(call=3), _dispatch_words(call=4)],
    "num_sms": [_dispatch_words(num_sms=24), _dispatch_words(num_sms=20)],
    "rejected": [_dispatch_words(), agreement.rejected("dispatch", 3, 1, ValueError("topk_idx: bad"))],
    "low-latency cap": [agreement.low_latency_dispatch(2, 1, torch.zeros(4, 128), torch.zeros(4, 2), m, 8, True,
                                                       False) for m in (128, 64)],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_message_is_the_reference_backends(case):
    rows = [list(r) for r in CASES[case]]
    err = agree_record.disagreement_error(rows, 1, 5)
    assert isinstance(err, ValueError)
    assert str(err) == _expected(rows), f"{case}: the CUDA text differs from agreement.check's"


def test_masked_ranks_count_as_agreeing_and_equal_rows_still_name_the_peer():
    mine = list(_dispatch_words())
    other = list(_dispatch_words(hidden=512))
    rows = [mine, [0] * agreement.WORDS, other]  # rank 1 masked: its words were never read
    err = agree_record.disagreement_error(rows, 2, W.HIDDEN, rank=0, left_out=[1])
    assert str(err) == _expected([mine, mine, other])
    # rows that, as read, agree (they cannot: a kernel found a difference) still give a ValueError naming the peer
    err = agree_record.disagreement_error([mine, mine], 1, W.HIDDEN)
    assert str(err).startswith("fingerprint: rank 1 disagreed") and "HIDDEN" in str(err)


def test_words_or_none():
    assert agree_record.words_or_none(None) == (0,) * agreement.WORDS
    assert agree_record.words_or_none([1, 2]) == (1, 2)


# ---- the deferred path: the AgreeRecord behind the error record ----------------------------------------
class FakeRecords:
    """read_error / clear_error of the error record and read_agree / clear_agree of the AgreeRecord."""

    WAIT_STAGES = {"disagree": 104, "invalid_ids": 100}

    def __init__(self):
        self.error = (0, 0, 0, 0, 0, 0)
        self.agree = (0, -1, -1, 0, [])
        self.cleared = []

    def read_error(self, _host):
        return self.error

    def clear_error(self, _host):
        self.error = (0, 0, 0, 0, 0, 0)
        self.cleared.append("error")

    def read_agree(self, _host):
        return self.agree

    def clear_agree(self, _host):
        self.agree = (0, -1, -1, 0, [])
        self.cleared.append("agree")


def _record(C_):
    r = DeviceErrorRecord.__new__(DeviceErrorRecord)
    r.C, r.err_host, r.agree_host, r.device, r.rank = C_, 0, 0, torch.device("cpu"), 0
    r.broken, r.broken_peer, r.masked, r.owed = False, None, frozenset(), []
    return r


def test_a_recorded_disagreement_is_a_value_error_and_the_buffer_stays_usable():
    fake = FakeRecords()
    rec = _record(fake)
    rows = [list(r) for r in CASES["hidden"]]
    fake.agree = (1, 1, int(W.HIDDEN), 9, rows)
    fake.error = (1, 0, 1, 104, 9, 0)
    err = rec.check_error(low_latency=True, defer_input=True)
    assert isinstance(err, ValueError) and str(err) == _expected(rows)
    assert sorted(fake.cleared) == ["agree", "error"] and not rec.broken
    assert rec.check_error(low_latency=True, defer_input=True) is None  # nothing left: the next call runs
    fake.agree, fake.error = (1, 1, int(W.HIDDEN), 9, rows), (1, 0, 1, 104, 9, 0)
    with pytest.raises(ValueError, match="x: the hidden size differs across ranks"):
        rec.check_error()  # not deferred: raised at once


def test_a_disagreement_recorded_while_another_error_is_held_stays_for_the_next_look():
    fake = FakeRecords()
    rec = _record(fake)
    fake.agree, fake.error = (1, 1, int(W.HIDDEN), 9, [list(r) for r in CASES["hidden"]]), (1, 0, 1, 104, 9, 0)
    assert rec.check_error(low_latency=True, defer_input=True, leave_input=True) is None
    assert fake.error[0] == 1 and fake.agree[0] == 1 and not fake.cleared


def test_an_incomplete_agree_record_still_raises_value_error():
    fake = FakeRecords()
    fake.error = (1, 0, -1, 104, 9, 0)
    err = _record(fake).check_error(defer_input=True)
    assert isinstance(err, ValueError) and str(err).startswith("fingerprint: the ranks disagreed")


# ---- the normal-mode calls (the stand-in NVLink context of test_cuda_host_path.py) ------------------------
def test_every_call_hands_its_words_to_its_crossing(env):  # noqa: F811
    b, ctx = env.b, env.ctx
    words = tuple(_dispatch_words())
    x, idx, w, E = _inputs()
    h = b.dispatch(x, idx, w, E, None, 1, fingerprint=words)[4]
    assert ctx.calls[-1]["fingerprint"] == words
    b.dispatch(x, None, w, E, h, 1, fingerprint=words[:2] + (9,) + words[3:])
    assert ctx.calls[-1]["fingerprint"][W.CALL] == 9
    _fresh(b)  # no fingerprint (a caller that takes no part): zeros, which the kernels skip
    assert ctx.calls[-1]["fingerprint"] == (0,) * agreement.WORDS


def test_a_fresh_dispatch_that_disagrees_raises_in_the_call_and_gives_the_block_back(env, monkeypatch):  # noqa: F811
    b, ctx = env.b, env.ctx
    rows = [list(r) for r in CASES["num_experts"]]
    b.nvl.counts_host = 1234
    seen = {}

    def read(counts_host, world_size):
        seen.update(host=counts_host, ranks=world_size)
        return 2, int(W.NUM_EXPERTS), rows

    names = {k: getattr(C, k) for k in dir(C) if not k.startswith("_")}
    monkeypatch.setattr(b, "C", types.SimpleNamespace(**dict(names, read_dispatch_disagreement=read)))
    ctx.status = 3
    with pytest.raises(ValueError) as e:
        _fresh(b)
    assert str(e.value) == _expected(rows) and seen == {"host": 1234, "ranks": 1}
    assert b.arena.free_bytes() == b.arena.nbytes  # the worst-case block went back
    ctx.status = 0
    assert _fresh(b)[0].shape == (64, 1024)  # and the next agreeing call runs


def test_a_rejected_normal_call_joins_the_exchange_in_stream_order(env):  # noqa: F811
    b, ctx = env.b, env.ctx
    sent = []
    ctx.agree_reject = lambda words, flags, wait, run, prev, start: sent.append((words, flags, wait, run, prev))
    words = agreement.rejected("combine", 5, 1, ValueError("x: bad"))
    b.reject(words)
    assert sent == [(tuple(words), 0, CALLER, CALLER, 0)]
    b.dispatch(*_inputs()[:2], None, 8, None, 1, async_finish=True)  # a call on the communication stream...
    end = b._last_end
    words = agreement.rejected("dispatch", 7, 1, ValueError("topk_idx: bad"))
    b.reject(words)
    assert end != 0 and sent[-1] == (tuple(words), 0, CALLER, CALLER, end)  # ...is waited for before the words go
    b.nvl.broken = True
    b.nvl.check_error = lambda **kw: (_ for _ in ()).throw(RuntimeError("broken"))
    b.reject(words)  # a Buffer that runs nothing sends nothing, and raises nothing over the caller's own error
    assert len(sent) == 2


# ---- low-latency rejects --------------------------------------------------------------------------------
class _LlCtx:
    def __init__(self):
        self.rejects = []

    def agree_reject(self, words, kind, slot, stream, compare=False, blocks=0):
        self.rejects.append((kind, slot) if not compare else (kind, slot, "compare"))


def _ll_backend(monkeypatch, ll):
    from deepcomm.cuda.call_errors import CallErrors
    from deepcomm.cuda.ll_calls import LowLatencyEngine
    record = types.SimpleNamespace(check_error=lambda **kw: None, timeout_ns=int(1e9))
    b = LowLatencyEngine(None, None, 0, 2, torch.device("cpu"), record, CallErrors(record), "ipc", 4)
    b.buffer = ll
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=CALLER))
    return b


def test_a_rejected_low_latency_call_takes_its_kinds_slot(monkeypatch):
    ll = types.SimpleNamespace(calls=3, ctx=_LlCtx(), put_peers=[])
    b = _ll_backend(monkeypatch, ll)
    b.reject(agreement.rejected("low_latency_dispatch", 4, 1, ValueError("x: bad")))
    assert ll.ctx.rejects == [(0, 1)] and ll.calls == 4  # slot 3 & 1, and the next dispatch takes the other
    b.reject(agreement.rejected("low_latency_combine", 5, 1, ValueError("handle: bad")))
    assert ll.ctx.rejects[-1] == (1, 1)  # the latest dispatch's slot


def test_a_rejected_first_low_latency_call_joins_the_buffers_exchange(monkeypatch):
    b = _ll_backend(monkeypatch, None)
    gathered = []
    b._agree_on_host = lambda words: (gathered.append(words), agreement.check([words, words]))
    words = agreement.rejected("low_latency_dispatch", 1, 1, ValueError("x: bad"))
    b.reject(words)  # the check names this rank's rejection: swallowed, the caller raises its own error
    assert gathered == [words]


def test_the_low_latency_buffer_is_made_only_after_every_rank_agrees(monkeypatch):
    import torch.distributed as dist
    b = _ll_backend(monkeypatch, None)
    b.group, b.world_size = None, 2
    mine = list(_dispatch_words(hidden=1024))
    theirs = list(_dispatch_words(hidden=2048))
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(
        slice(None), [obj, theirs]))
    with pytest.raises(ValueError) as e:
        b._buffer_for(8, 128, 1024, mine)
    assert str(e.value) == _expected([mine, theirs]) and b.buffer is None


# ---- a new low-latency shape once the buffer exists -------------------------------------------------------
class _OldBuffer:
    def __init__(self):
        self.key, self.calls, self.put_peers, self.ctx, self.closed = (8, 128, 1024), 5, [], _LlCtx(), False

    def close(self):
        self.closed = True


def _shape_change(monkeypatch, looks):
    """An engine whose buffer has shape (8, 128, 1024); ``looks``: what successive check_error calls return."""
    import contextlib
    from deepcomm.cuda import ll_calls
    from deepcomm.cuda.call_errors import CallErrors
    looks = list(looks)
    synced = []
    record = types.SimpleNamespace(check_error=lambda **kw: looks.pop(0) if looks else None, masked=frozenset(),
                                   err_dev=0, timeout_ns=1)
    b = ll_calls.LowLatencyEngine(None, None, 0, 2, torch.device("cpu"), record, CallErrors(record), "ipc", 4)
    old = b.buffer = _OldBuffer()
    stream = types.SimpleNamespace(cuda_stream=CALLER)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    # each device synchronize, as the exchanges queued by then: before the exchange, and after it
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(len(old.ctx.rejects)))
    monkeypatch.setattr(torch.cuda, "device", lambda device=None: contextlib.nullcontext())
    made = []
    monkeypatch.setattr(ll_calls, "LlBuffer", lambda *a, **kw: made.append(a[5:8]) or types.SimpleNamespace(
        key=tuple(a[5:8]), calls=0))
    b._agree_on_host = lambda words: None
    return b, old, synced, made


def test_a_new_low_latency_shape_is_compared_through_the_old_buffer_first(monkeypatch):
    words = agreement.low_latency_dispatch(7, 1, torch.zeros(4, 2048), torch.zeros(4, 2), 128, 8, False, False)
    disagreement = ValueError("x: the hidden size differs across ranks in low_latency_dispatch call #7 ...")
    b, old, synced, made = _shape_change(monkeypatch, [None, disagreement])
    with pytest.raises(ValueError) as e:
        b._buffer_for(8, 128, 2048, words)
    assert e.value is disagreement
    # a dispatch send of the words into the old buffer's slot (5 & 1), compared, waited for; the buffer is kept
    assert old.ctx.rejects == [(0, 1, "compare")] and old.calls == 6 and synced == [0, 1]
    assert b.buffer is old and not old.closed and not made


def test_a_new_low_latency_shape_every_rank_agrees_on_remakes_the_buffer(monkeypatch):
    words = agreement.low_latency_dispatch(7, 1, torch.zeros(4, 2048), torch.zeros(4, 2), 128, 8, False, False)
    b, old, synced, made = _shape_change(monkeypatch, [None, None])
    ll = b._buffer_for(8, 128, 2048, words)
    assert old.ctx.rejects == [(0, 1, "compare")] and synced[:2] == [0, 1] and old.closed
    assert made == [(8, 128, 2048)] and ll.key == (8, 128, 2048) and b.buffer is ll


def test_a_new_low_latency_shape_raises_an_earlier_error_first_as_the_other_ranks_do(monkeypatch):
    words = agreement.low_latency_dispatch(7, 1, torch.zeros(4, 2048), torch.zeros(4, 2), 128, 8, False, False)
    earlier, disagreement = ValueError("topk_idx: an earlier call's"), ValueError("x: the hidden size differs")
    b, old, _, _ = _shape_change(monkeypatch, [earlier, disagreement])
    with pytest.raises(ValueError) as e:
        b._buffer_for(8, 128, 2048, words)
    assert e.value is earlier and b.errors.pending is disagreement and b.buffer is old


def _with_put_peers(b, old, monkeypatch):
    """``old`` with a put peer; returns the log of what the exchange does, in order: the words-only send half
    (``publish``), the puts, the comparing launch, device synchronizes and looks at the record."""
    log = []
    old.put_peers = [1]
    old.ctx.agree_reject = lambda words, kind, slot, stream, compare=False, blocks=0: log.append(
        ("publish", tuple(words), kind, slot, stream, compare, blocks))
    old.ctx.agree_compare = lambda words, kind, slot, stream: log.append(
        ("compare", tuple(words), kind, slot, stream))
    old.put = lambda kind, slot, stream, masked: log.append(("put", kind, slot, stream, masked))
    old.put_weights = lambda slot, stream, masked: log.append(("put_weights", slot, stream, masked))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("synchronize"))
    looks = b.record.check_error
    b.record.check_error = lambda **kw: log.append("look") or looks(**kw)
    return log


def test_a_new_low_latency_shape_with_put_peers_is_put_then_compared_in_a_launch_of_its_own(monkeypatch):
    words = agreement.low_latency_dispatch(7, 1, torch.zeros(4, 2048), torch.zeros(4, 2), 128, 8, False, False)
    disagreement = ValueError("x: the hidden size differs across ranks in low_latency_dispatch call #7 ...")
    b, old, _, made = _shape_change(monkeypatch, [None, disagreement])
    b.record.masked = frozenset({3})
    log = _with_put_peers(b, old, monkeypatch)
    with pytest.raises(ValueError) as e:
        b._buffer_for(8, 128, 2048, words)
    assert e.value is disagreement
    # the earlier calls' record first; then the words-only dispatch send into slot 5 & 1 (raising the peers' 4
    # blocks' arrival words), its data and flags puts to the live peers, the comparing launch after them, the wait
    # and the record; the buffer is kept
    assert log == ["synchronize", "look",
                   ("publish", tuple(words), 0, 1, CALLER, False, 4),
                   ("put", 0, 1, CALLER, frozenset({3})),
                   ("compare", tuple(words), 0, 1, CALLER),
                   "synchronize", "look"]
    assert old.calls == 6 and b.buffer is old and not old.closed and not made


def test_a_new_low_latency_shape_with_put_peers_every_rank_agrees_on_remakes_the_buffer(monkeypatch):
    words = agreement.low_latency_dispatch(7, 1, torch.zeros(4, 2048), torch.zeros(4, 2), 128, 8, False, False)
    b, old, _, made = _shape_change(monkeypatch, [None, None])
    log = _with_put_peers(b, old, monkeypatch)
    ll = b._buffer_for(8, 128, 2048, words)
    assert [e[0] if isinstance(e, tuple) else e for e in log[:7]] == [
        "synchronize", "look", "publish", "put", "compare", "synchronize", "look"]
    assert old.closed and made == [(8, 128, 2048)] and b.buffer is ll


def test_a_new_low_latency_shape_of_a_combine_with_put_peers_goes_with_the_weights(monkeypatch):
    x = torch.zeros(4, 256, 2048, dtype=torch.bfloat16)
    words = agreement.low_latency_combine(7, 1, x, torch.zeros(4, 2), types.SimpleNamespace(call=6), False)
    b, old, _, _ = _shape_change(monkeypatch, [None, None])
    log = _with_put_peers(b, old, monkeypatch)
    b._buffer_for(8, 128, 2048, words)
    # the latest dispatch's slot ((5 - 1) & 1); a combine's words reach put peers with its weights
    assert log[2:5] == [("publish", tuple(words), 1, 0, CALLER, False, 4), ("put_weights", 0, CALLER, frozenset()),
                        ("compare", tuple(words), 1, 0, CALLER)]
    assert old.calls == 5
