"""How the CUDA backend raises input errors that kernels record on the device (deepcomm/cuda/nvl_buffer.py
check_error, deepcomm/cuda/backend.py _check / _raise_pending), on CPU with a stand-in for the error record: an
earlier call's error is held while the current call joins its collective and raised after it, one at a time, the
next left recorded; a record still being written waits; a timeout raises at once and marks the Buffer broken."""
import pytest

from deepcomm.cuda.backend import CudaBackend
from deepcomm.cuda.nvl_buffer import NvlBuffer
from deepcomm.errors import CommTimeoutError


class FakeRecord:
    """The mapped-host error record: (flag, rank, peer, stage, seq, waited_ns); flag 2 = being written."""

    def __init__(self):
        self.record = (0, 0, 0, 0, 0, 0)

    def read_error(self, _host):
        return self.record

    def clear_error(self, _host):
        self.record = (0, 0, 0, 0, 0, 0)


def _nvl(record):
    nvl = NvlBuffer.__new__(NvlBuffer)  # no device memory: only the error-record logic is exercised
    nvl.C, nvl.err_host = record, 0
    nvl.broken, nvl.broken_peer, nvl.masked = False, None, frozenset()
    return nvl


def _backend(record):
    b = CudaBackend.__new__(CudaBackend)
    b.nvl, b._pending_input = _nvl(record), None
    return b


def test_input_error_is_held_and_raised_after_the_call():
    rec = FakeRecord()
    b = _backend(rec)
    rec.record = (1, 0, 1, 102, 7, 0)  # rank 1 passed bad low-latency ids
    b._check(low_latency=True)  # the call goes on
    assert rec.record[0] == 0 and b._pending_input is not None
    rec.record = (1, 0, 0, 103, 8, 0)  # another one, recorded while the first is held: stays recorded
    b._check(low_latency=True)
    assert rec.record[0] == 1
    with pytest.raises(ValueError, match="on rank 1 had expert ids outside"):
        b._raise_pending()
    b._raise_pending()  # nothing held any more
    b._check(low_latency=True)  # the next call takes the second one
    with pytest.raises(ValueError, match="on rank 0 had a token naming the same expert twice"):
        b._raise_pending()


def test_record_being_written_waits_and_timeouts_raise_at_once():
    rec = FakeRecord()
    b = _backend(rec)
    rec.record = (2, 0, 1, 8, 3, 0)  # flag 2: the kernel is still writing it
    b._check(low_latency=True)
    assert b._pending_input is None and not b.nvl.broken
    rec.record = (1, 0, 1, 8, 3, 5_000_000_000)  # a timed-out wait for rank 1's low-latency data
    with pytest.raises(CommTimeoutError):
        b._check(low_latency=True)
    assert b.nvl.broken and b.nvl.broken_peer == 1
    with pytest.raises(RuntimeError, match="had a communication timeout"):
        b._check(low_latency=True)


def test_check_error_modes():
    rec = FakeRecord()
    nvl = _nvl(rec)
    rec.record = (1, 0, -1, 100, 1, 0)
    assert nvl.check_error(defer_input=True, leave_input=True) is None and rec.record[0] == 1
    err = nvl.check_error(defer_input=True)
    assert isinstance(err, ValueError) and str(err).startswith("topk_idx:") and rec.record[0] == 0
    rec.record = (1, 0, 1, 101, 1, 0)
    with pytest.raises(ValueError, match="num_worst_tokens: rank 1"):
        nvl.check_error()
