"""The internode backend's normal mode after a call raised inside its exchange (deepcomm/internode/backend.py
``_break_if_joined``), on the CPU with stand-ins for its kernels and records: an error after the call's first
exchange began that is not every rank's (not a ValueError, not a timeout) breaks the Buffer, and every later call
is refused saying why; an error before any exchange, or a ValueError every rank raises alike, leaves it usable."""
from __future__ import annotations

import contextlib
import types

import pytest
import torch

from deepcomm.errors import CommTimeoutError
from deepcomm.internode import backend as IB
from deepcomm.internode.exchange_record import TIMED_OUT, RecordedWaits


class _Record(RecordedWaits):
    """A transport or node link's broken state and counters (no mapped memory)."""

    def __init__(self):
        self.broken, self.err_host, self.round, self.epoch = False, 0, 0, 0


class _Kernels:
    """hier_kernels' calls as the backend makes them: ``fail`` raised after ``rounds`` exchange rounds began."""

    def __init__(self, backend):
        self.b, self.fail, self.rounds = backend, None, 1

    def check_deferred(self):
        for record in (self.b.transport, self.b.link):
            if record.broken:
                raise record.broken_error()

    def call(self, *args):
        self.check_deferred()
        self.b.transport.round += self.rounds
        if self.fail is not None:
            raise self.fail
        return "done"


@pytest.fixture
def backend(monkeypatch):
    b = IB.InternodeBackend.__new__(IB.InternodeBackend)
    b.device = torch.device("cpu")
    b.transport, b.link = _Record(), _Record()
    b.ll = types.SimpleNamespace(engine=types.SimpleNamespace(joined=0),
                                 record=types.SimpleNamespace(check_error=lambda **kw: None))
    b.kernels = _Kernels(b)
    monkeypatch.setattr(IB.hier_kernels, "dispatch", lambda kernels, *args: kernels.call())
    monkeypatch.setattr(IB.hier_kernels, "combine", lambda kernels, *args: kernels.call())
    monkeypatch.setattr(IB.torch.cuda, "device", lambda device: contextlib.nullcontext())
    return b


def _dispatch(b, handle=None):
    return b.dispatch(torch.zeros(4, 8), None, None, 8, handle, 1)


def _combine(b):
    return b.combine(torch.zeros(4, 8), None, None)


@pytest.mark.parametrize("call,run", [("dispatch", _dispatch), ("combine", _combine)])
def test_an_error_after_the_exchange_began_breaks_the_buffer_saying_why(backend, call, run):
    backend.kernels.fail = RuntimeError("CUDA error: launch failed (simulated)")
    with pytest.raises(RuntimeError, match="launch failed"):
        run(backend)
    assert backend.transport.broken
    backend.kernels.fail = None
    with pytest.raises(RuntimeError, match=f"this Buffer's {call} failed inside its crossing") as e:
        run(backend)
    assert "RuntimeError: CUDA error: launch failed" in str(e.value) and "on every rank" in str(e.value)
    with pytest.raises(RuntimeError, match=f"this Buffer's {call} failed"):  # every later call, of any kind
        _dispatch(backend, handle=types.SimpleNamespace(num_recv_tokens_per_expert=[1], num_recv=4))


@pytest.mark.parametrize("error", [ValueError("x: a block exceeds the receive slot on every rank"),
                                   CommTimeoutError(0, 1, "internode:credit")])
def test_every_ranks_errors_after_the_exchange_do_not_add_a_break(backend, error):
    """A ValueError after the exchange is every rank's (decided from what they exchanged): the Buffer goes on; a
    timeout breaks it by its own record, with its own text."""
    backend.kernels.fail = error
    with pytest.raises(type(error)):
        _dispatch(backend)
    assert not backend.transport.broken and backend.transport.broken_reason is None
    backend.kernels.fail = None
    assert _dispatch(backend) == "done"


def test_an_error_before_any_exchange_leaves_the_buffer_usable(backend):
    """No round began (joined_calls unchanged): the Buffer rejects the call for the peers and goes on."""
    backend.kernels.rounds = 0
    backend.kernels.fail = RuntimeError("out of memory (simulated)")
    with pytest.raises(RuntimeError, match="out of memory"):
        _combine(backend)
    assert not backend.transport.broken
    backend.kernels.fail, backend.kernels.rounds = None, 1
    assert _combine(backend) == "done"


def test_a_timeout_break_keeps_its_own_text():
    record = _Record()
    record.broken = True
    assert str(record.broken_error()) == TIMED_OUT
    record.set_broken_by("combine", RuntimeError("x"))  # already broken: the first reason stays
    assert record.broken_reason is None
