"""The host side of a normal-mode call meeting a low-latency call on the CUDA backend (deepcomm/cuda/mode_meet.py),
on the CPU: the error text is the reference backend's, each rank notes the call it owes to the other mode, reads
its record after a switch of mode, and pays that call before its next call of that mode, in the slot its peers
used. The kernels' side is tested on GPUs (tests/agreement/test_agreement_modes_gpu.py)."""
import types

import pytest
import torch

from deepcomm import agreement
from deepcomm.cuda import agree_record
from deepcomm.cuda.call_errors import CallErrors
from deepcomm.cuda.ll_calls import LowLatencyEngine
from deepcomm.cuda.mode_meet import ModeMeet

from tests.normal.test_cuda_host_path import CALLER, _inputs, env  # noqa: F401  (env is a fixture)

W = agreement.Word
x, idx = torch.zeros(4, 256, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int64)
NORMAL = agreement.dispatch(4, 1, x, idx, None, 8, None)
LOW = agreement.low_latency_dispatch(4, 1, x, idx, 16, 8, False, False)
LOW_COMBINE = agreement.make(agreement.Op.LOW_LATENCY_COMBINE, 4, 1, hidden=256, x_dtype=1, topk=2, weights=True,
                             handle=3)


def test_the_owed_call_is_the_other_modes_peer_words():
    rows = [list(NORMAL), list(LOW), list(NORMAL)]
    assert agree_record.other_mode_words(rows, 0) == LOW
    assert agree_record.other_mode_words(rows, 1) == NORMAL
    assert agree_record.other_mode_words([list(NORMAL), list(NORMAL)], 0) is None  # same mode: nothing owed
    later = list(LOW)
    later[W.CALL] = 5
    assert agree_record.other_mode_words([list(NORMAL), later], 0) is None  # another call: not a meeting
    assert agree_record.other_mode_words([[0] * agreement.WORDS, list(LOW)], 0) is None
    assert agree_record.other_mode_words(rows, None) is None


class FakeRecords:
    def __init__(self, rows):
        self.rows = rows

    def read_agree(self, _host):
        return 1, 1, int(W.OP), 9, self.rows

    def clear_agree(self, _host):
        pass

    def read_dispatch_disagreement(self, _host, _n):
        return 2, int(W.OP), self.rows


def test_the_message_is_the_reference_backends_and_the_owed_call_is_noted():
    rows = [list(NORMAL), list(LOW)]
    owed = []
    err = agree_record.recorded_disagreement(FakeRecords(rows), 0, 0, owed=owed)
    with pytest.raises(ValueError) as ref:
        agreement.check(rows)
    assert str(err) == str(ref.value)
    assert str(err).startswith("call order: the ranks are in different calls on this Buffer (dispatch #4 on rank 0 "
                               "vs low_latency_dispatch #4 on rank 1)")
    assert owed == [LOW]
    owed = []
    err = agree_record.dispatch_disagreement(FakeRecords(rows), 0, 2, 1, owed)
    assert str(err) == str(ref.value) and owed == [NORMAL]


def _meet(monkeypatch, owed):
    nvl = types.SimpleNamespace(owed=list(owed), ctx=types.SimpleNamespace(set_cross_slots=lambda *a: None))
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    return ModeMeet(nvl, torch.device("cpu")), nvl, syncs


class Looks:
    def __init__(self):
        self.looks = 0

    def check(self, low_latency=False):
        self.looks += 1


def test_a_switch_of_mode_reads_the_record_and_hands_over_the_calls_owed_to_that_mode(monkeypatch):
    meet, nvl, syncs = _meet(monkeypatch, [LOW, NORMAL])
    errors = Looks()
    assert meet.enter(False, errors) == [NORMAL]  # the first call: no switch, no wait
    assert syncs == [] and errors.looks == 0 and nvl.owed == [LOW]
    assert meet.enter(False, errors) == [] and syncs == []  # the same mode again: no wait
    assert meet.enter(True, errors) == [LOW]  # a switch: wait for the device, then read the record
    assert len(syncs) == 1 and errors.looks == 1 and nvl.owed == []
    assert meet.enter(True, errors) == [] and len(syncs) == 1


def test_a_new_low_latency_buffer_voids_the_low_latency_calls_owed(monkeypatch):
    meet, nvl, _ = _meet(monkeypatch, [LOW, NORMAL])
    meet.unlink()
    assert nvl.owed == [NORMAL]


class _LlCtx:
    def __init__(self):
        self.rejects = []

    def agree_reject(self, words, kind, slot, stream, compare=False):
        self.rejects.append((tuple(words), kind, slot))


def test_the_low_latency_engine_pays_an_owed_call_in_the_slot_its_peers_used(monkeypatch):
    meet, nvl, _ = _meet(monkeypatch, [LOW])
    record = types.SimpleNamespace(check_error=lambda **kw: None, masked=frozenset())
    b = LowLatencyEngine(None, None, 0, 2, torch.device("cpu"), record, CallErrors(record), "ipc", 4, meet=meet)
    ll = types.SimpleNamespace(calls=3, ctx=_LlCtx(), put_peers=[])
    b._enter(ll, 7)
    assert ll.ctx.rejects == [(LOW, 0, 1)] and ll.calls == 4  # the dispatch slot 3 & 1; the next takes the other
    b._note_slot(agreement.low_latency_dispatch(3, 1, x, idx, 16, 8, False, False), 0)
    nvl.owed = [LOW_COMBINE]  # a combine of the handle of call #3 (slot 0 here)
    b._enter(ll, 7)
    assert ll.ctx.rejects[-1] == (LOW_COMBINE, 1, 0) and ll.calls == 4
    nvl.owed = [NORMAL]
    b._enter(ll, 7)
    assert len(ll.ctx.rejects) == 2 and nvl.owed == [NORMAL]  # owed to normal mode: left for it


def test_a_normal_call_first_pays_the_normal_call_owed_in_stream_order(env):  # noqa: F811
    b, ctx = env.b, env.ctx
    sent = []
    ctx.agree_reject = lambda words, flags, wait, run, prev, start: sent.append((words, flags, wait, run, prev))
    b.nvl.owed = [NORMAL, LOW]
    b.dispatch(*_inputs()[:2], None, 8, None, 1)
    assert sent == [(NORMAL, 0, CALLER, CALLER, 0)]  # before the dispatch, on its stream
    assert b.nvl.owed == [LOW] and len(ctx.calls) == 1, "the dispatch itself still ran"
    b.dispatch(*_inputs()[:2], None, 8, None, 1)
    assert len(sent) == 1  # paid once


class _FirstCallRecord:
    """The NVLink buffer's record as first_low_latency_call reads it: ``err`` is what the look finds, and like
    recorded_disagreement the look notes the normal-mode peer's words as owed."""

    def __init__(self, err=None, masked=frozenset()):
        self.err, self.masked, self.owed = err, masked, [LOW_COMBINE]
        self.exchanged = False  # the kernel records the difference only once the words were exchanged

    def check_error(self, low_latency=False, defer_input=False, leave_input=False):
        if self.err is not None and self.exchanged and defer_input and not leave_input:
            self.owed.append(NORMAL)
            self.exchanged = False
            return self.err
        return None


def _first_call(monkeypatch, nvl):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append("device"))
    sent = []

    def exchange(words):
        sent.append(words)
        synced.append("exchange")
        nvl.exchanged = True

    meet = ModeMeet(nvl, torch.device("cpu"), normal_exchange=exchange)
    return meet, sent, synced


def test_the_first_low_latency_call_meets_a_normal_call_in_the_nvlink_slots(monkeypatch):
    diff = ValueError("call order: ... (dispatch #4 on rank 0 vs low_latency_dispatch #4 on rank 1) ...")
    nvl = _FirstCallRecord(err=diff)
    meet, sent, synced = _first_call(monkeypatch, nvl)
    with pytest.raises(ValueError) as got:
        meet.first_low_latency_call(list(LOW), CallErrors(nvl))
    # the device's earlier work waited for and its record read, then the words exchanged, waited for and read
    assert got.value is diff and sent == [LOW] and synced == ["device", "exchange", "device"]
    assert nvl.owed == [LOW_COMBINE], "this rank took its normal-mode number: it owes no normal-mode call"
    nvl.err = None
    assert meet.first_low_latency_call(LOW, CallErrors(nvl)) is True and len(sent) == 2


def test_an_earlier_input_error_is_raised_first_and_the_difference_kept(monkeypatch):
    diff = ValueError("call order: ...")
    nvl = _FirstCallRecord(err=diff)
    meet, _, _ = _first_call(monkeypatch, nvl)
    errors = CallErrors(nvl)
    earlier = ValueError("topk_idx: an earlier call ...")
    errors.pending = earlier
    with pytest.raises(ValueError) as got:
        meet.first_low_latency_call(LOW, errors)
    assert got.value is earlier and errors.pending is diff


def test_a_rejected_first_call_leaves_the_difference_naming_it_and_an_earlier_error_as_they_are(monkeypatch):
    nvl = _FirstCallRecord(err=ValueError("call: rank 1 rejected low_latency_dispatch call #4 ..."))
    meet, sent, _ = _first_call(monkeypatch, nvl)
    errors = CallErrors(nvl)
    earlier = ValueError("topk_idx: an earlier call ...")
    errors.pending = earlier
    assert meet.first_low_latency_call(LOW, errors, rejected=True) is True
    assert sent == [LOW] and errors.pending is earlier and nvl.owed == [LOW_COMBINE]


def test_no_words_exchange_without_words_with_masked_ranks_or_without_a_backend_hook(monkeypatch):
    meet, sent, _ = _first_call(monkeypatch, _FirstCallRecord(masked=frozenset({1})))
    assert meet.first_low_latency_call(LOW, CallErrors(meet.nvl)) is False
    meet, sent, _ = _first_call(monkeypatch, _FirstCallRecord())
    assert meet.first_low_latency_call(None, CallErrors(meet.nvl)) is False
    meet.normal_exchange = None
    assert meet.first_low_latency_call(LOW, CallErrors(meet.nvl)) is False and sent == []


def test_linking_a_new_low_latency_buffer_voids_the_low_latency_calls_owed(monkeypatch):
    meet, nvl, _ = _meet(monkeypatch, [LOW, NORMAL, LOW_COMBINE])
    meet.link(types.SimpleNamespace(put_peers=[0], ctx=types.SimpleNamespace(set_cross_slots=lambda *a: None)))
    assert nvl.owed == [NORMAL]


class _Exchanges:
    """A LowLatencyEngine's two first exchanges, recorded: the NVLink one (ModeMeet.first_low_latency_call,
    ``ran``: whether it could run) and the host one."""

    def __init__(self, ran):
        self.ran, self.seen = ran, []

    def first_low_latency_call(self, words, errors, rejected=False):
        self.seen.append(("nvlink", words, rejected))
        return self.ran


@pytest.mark.parametrize("ran", [True, False])
def test_a_rejected_first_low_latency_call_joins_the_exchange_its_peers_make(ran):
    record = types.SimpleNamespace(check_error=lambda **kw: None, masked=frozenset(), timeout_ns=10**9)
    meet = _Exchanges(ran)
    b = LowLatencyEngine(None, None, 0, 2, torch.device("cpu"), record, CallErrors(record), "ipc", 4, meet=meet)
    b._agree_on_host = lambda words: meet.seen.append(("host", words))
    b.reject(LOW)
    assert meet.seen == ([("nvlink", LOW, True)] if ran else [("nvlink", LOW, True), ("host", LOW)])


def test_the_first_low_latency_call_exchanges_through_the_nvlink_slots_before_the_host(monkeypatch):
    record = types.SimpleNamespace(check_error=lambda **kw: None, masked=frozenset(), timeout_ns=10**9)
    meet = _Exchanges(True)
    b = LowLatencyEngine(None, None, 0, 2, torch.device("cpu"), record, CallErrors(record), "ipc", 4, meet=meet)

    def host(words):
        meet.seen.append(("host", words))
        raise ValueError("stop before the buffer is made")

    b._agree_on_host = host
    with pytest.raises(ValueError, match="stop before"):
        b._buffer_for(8, 16, 256, LOW)
    assert meet.seen == [("nvlink", LOW, False), ("host", LOW)] and b.joined == 1


def test_the_nvlink_exchange_is_a_normal_call_that_compares_after_the_calls_owed(env):  # noqa: F811
    b, ctx = env.b, env.ctx
    sent = []
    ctx.agree_reject = lambda words, flags, wait, run, prev, start, compare=False: sent.append(
        (words, flags, wait, run, prev, compare))
    b.nvl.owed = [NORMAL, LOW]
    b.meet.normal_exchange(LOW)
    assert sent == [(NORMAL, 0, CALLER, CALLER, 0, False), (LOW, 0, CALLER, CALLER, 0, True)]
    assert b.nvl.owed == [LOW] and ctx.calls == []


def test_a_rejected_later_low_latency_call_waits_for_the_words_and_notes_the_call_it_owes(monkeypatch):
    """A rank that rejected a low-latency call once the buffer exists compares its words too, and reads the record
    after a device synchronize: a peer met in a normal-mode call leaves the normal-mode call this rank owes (the
    record notes it), which keeps both modes' call numbers in step; the difference itself is dropped (the rank
    raises its own error). Peers reached by puts compare nothing."""
    meet, nvl, syncs = _meet(monkeypatch, [])
    order = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: order.append("sync"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=7))

    def check_error(low_latency=False, defer_input=False, leave_input=False):
        order.append(("record", low_latency, defer_input))
        nvl.owed.append(NORMAL)  # as recorded_disagreement notes a peer in a normal-mode call
        return ValueError("call order: ...")

    record = types.SimpleNamespace(check_error=check_error, masked=frozenset())
    errors = types.SimpleNamespace(check=lambda low_latency=False: order.append("look"), take_pending=lambda: None,
                                   pending=None)
    b = LowLatencyEngine(None, None, 0, 2, torch.device("cpu"), record, errors, "ipc", 4, meet=meet)

    class Ctx:
        def agree_reject(self, words, kind, slot, stream, compare=False, blocks=0):
            order.append(("reject", kind, slot, compare))

    b.buffer = types.SimpleNamespace(calls=3, ctx=Ctx(), put_peers=[])
    rejected = agreement.rejected("low_latency_dispatch", 4, 1, ValueError("x: bad"))
    b.reject(rejected)
    assert order == ["sync", "look", ("reject", 0, 1, True), "sync", ("record", True, True)], order
    assert nvl.owed == [NORMAL]  # paid before this rank's next normal-mode call
    order.clear()
    errors.pending = ValueError("topk_idx: an earlier call's bad ids")  # kept: a second may wait in the record
    b.buffer = types.SimpleNamespace(calls=3, ctx=Ctx(), put_peers=[])
    b.reject(rejected)
    assert order == ["sync", "look", ("reject", 0, 1, False)], order  # that record is left for a later look
    order.clear()
    errors.pending = None
    b.buffer = types.SimpleNamespace(calls=3, ctx=Ctx(), put_peers=[1], put=lambda *a: order.append("put"))
    b.reject(rejected)
    assert order == ["look", ("reject", 0, 1, False), "put"], order
