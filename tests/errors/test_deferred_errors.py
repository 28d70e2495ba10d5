"""How the CUDA backends raise input errors that kernels record on the device (deepcomm/cuda/error_record.py
check_error, deepcomm/cuda/call_errors.py CallErrors), on CPU with a stand-in for the error record: an
earlier call's error is held while the current call joins its collective and raised after it, one at a time, the
next left recorded; a record still being written waits; a timeout raises at once and marks the Buffer broken.
The same for the internode backend's low-latency mode (internode_ll.py), whose record also gates its normal mode."""
import pytest
import torch

from deepcomm._ext import load_extension
from deepcomm.cuda.call_errors import CallErrors
from deepcomm.cuda.error_record import DeviceErrorRecord
from deepcomm.internode.backend import InternodeBackend
from deepcomm.internode.internode_ll import InternodeLowLatency, low_latency_memory_for
from deepcomm.nvlink.nvl_buffer import NvlBuffer
from deepcomm.errors import CommTimeoutError


# The stage numbers the kernels write (the extension's WAIT_STAGES); without the extension, those of the stages
# these tests record, as csrc/runtime/error_record.cuh numbers them.
WAIT_STAGES = getattr(load_extension(), "WAIT_STAGES", None) or {
    "ll_dispatch_data": 8, "ll_combine_data": 9, "invalid_ids": 100, "overflow": 101, "ll_invalid_ids": 102,
    "ll_duplicate_ids": 103, "layout_invalid_ids": 105}
S = WAIT_STAGES


class FakeRecord:
    """The extension's error-record calls on a mapped-host record: (flag, rank, peer, stage, seq, waited_ns); flag
    2 = being written."""

    WAIT_STAGES = WAIT_STAGES

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


def _record(record):
    r = DeviceErrorRecord.__new__(DeviceErrorRecord)  # the internode backend's low-latency record, likewise
    r.C, r.err_host, r.device = record, 0, torch.device("cpu")
    r.broken, r.broken_peer, r.masked = False, None, frozenset()
    return r


def _errors(record, kind):
    """CallErrors over the NVLink buffer's record (CudaBackend) or the internode backend's low-latency record."""
    return CallErrors(_nvl(record) if kind == "nvlink" else _record(record))


def _internode_ll(record):
    part = InternodeLowLatency.__new__(InternodeLowLatency)
    part.errors = _errors(record, "internode")
    part.record = part.errors.record
    return part


BACKENDS = ["nvlink", "internode"]


@pytest.mark.parametrize("cls", BACKENDS)
def test_input_error_is_held_and_raised_after_the_call(cls):
    rec = FakeRecord()
    b = _errors(rec, cls)
    rec.record = (1, 0, 1, S["ll_invalid_ids"], 7, 0)  # rank 1 passed bad low-latency ids
    b.check(low_latency=True)  # the call goes on
    assert rec.record[0] == 0 and b.pending is not None
    rec.record = (1, 0, 0, S["ll_duplicate_ids"], 8, 0)  # another one, recorded while the first is held: stays recorded
    b.check(low_latency=True)
    assert rec.record[0] == 1
    with pytest.raises(ValueError, match="on rank 1 had expert ids outside"):
        b.raise_pending()
    b.raise_pending()  # nothing held any more
    b.check(low_latency=True)  # the next call takes the second one
    with pytest.raises(ValueError, match="on rank 0 had a token naming the same expert twice"):
        b.raise_pending()


@pytest.mark.parametrize("cls", BACKENDS)
def test_record_being_written_waits_and_timeouts_raise_at_once(cls):
    rec = FakeRecord()
    b = _errors(rec, cls)
    rec.record = (2, 0, 1, S["ll_dispatch_data"], 3, 0)  # flag 2: the kernel is still writing it
    b.check(low_latency=True)
    assert b.pending is None and not b.record.broken
    rec.record = (1, 0, 1, S["ll_dispatch_data"], 3, 5_000_000_000)  # a timed-out wait for rank 1's low-latency data
    with pytest.raises(CommTimeoutError):
        b.check(low_latency=True)
    assert b.record.broken and b.record.broken_peer == 1
    with pytest.raises(RuntimeError, match="had a communication timeout"):
        b.check(low_latency=True)


def test_check_error_modes():
    rec = FakeRecord()
    nvl = _nvl(rec)
    rec.record = (1, 0, -1, S["invalid_ids"], 1, 0)
    assert nvl.check_error(defer_input=True, leave_input=True) is None and rec.record[0] == 1
    err = nvl.check_error(defer_input=True)
    assert isinstance(err, ValueError) and str(err).startswith("topk_idx:") and rec.record[0] == 0
    rec.record = (1, 0, 1, S["overflow"], 1, 0)
    with pytest.raises(ValueError, match="num_worst_tokens: rank 1"):
        nvl.check_error()


def test_internode_normal_mode_reads_the_low_latency_record():
    """The internode backend's normal mode refuses to run while ranks are masked or after a low-latency timeout,
    as on one node, and leaves a low-latency input error recorded for the low-latency call that raises it."""
    rec = FakeRecord()
    backend = InternodeBackend.__new__(InternodeBackend)
    backend.ll = _internode_ll(rec)
    rec.record = (1, 0, 1, S["ll_invalid_ids"], 4, 0)  # bad ids in an earlier low-latency dispatch of rank 1
    backend._normal_mode_check()
    assert rec.record[0] == 1
    backend.ll.errors.check(low_latency=True)
    with pytest.raises(ValueError, match="on rank 1 had expert ids outside"):
        backend.ll.errors.raise_pending()
    backend.ll.record.masked = frozenset({1})
    with pytest.raises(RuntimeError, match=r"ranks \[1\] are masked"):
        backend._normal_mode_check()
    backend.ll.record.masked = frozenset()
    # a low-latency combine that timed out waiting for rank 1
    rec.record = (1, 0, 1, S["ll_combine_data"], 5, 3_000_000_000)
    with pytest.raises(CommTimeoutError, match="low_latency_combine:data"):
        backend._normal_mode_check()
    with pytest.raises(RuntimeError, match="destroy it"):
        backend._normal_mode_check()


def test_internode_low_latency_memory():
    """CUDA IPC cannot map across hosts: ranks on several hosts get NVSHMEM memory whatever was configured."""
    assert low_latency_memory_for(["a", "a"], "ipc") == "ipc"
    assert low_latency_memory_for(["a", "a"], "nvshmem") == "nvshmem"
    assert low_latency_memory_for(["a", "b", "a", "b"], "ipc") == "nvshmem"


def test_an_empty_record_is_read_in_place_without_the_extension():
    """Every call looks at the record: while its flag word is 0 the look reads that word in place and asks the
    extension nothing; once a kernel claims the flag, the extension reads the whole record."""
    import ctypes

    class Counting(FakeRecord):
        reads = 0

        def read_error(self, host):
            Counting.reads += 1
            return super().read_error(host)

    fake = Counting()
    mem = (ctypes.c_int * 8)()
    rec = _record(fake)
    rec.err_host = ctypes.addressof(mem)
    rec._flag_word = ctypes.c_int.from_address(rec.err_host)
    assert rec.check_error() is None and rec.check_error(low_latency=True) is None and Counting.reads == 0
    mem[0] = 1  # a kernel recorded a timeout
    fake.record = (1, 0, 1, 3, 7, 5_000_000_000)
    with pytest.raises(CommTimeoutError):
        rec.check_error()
    assert Counting.reads == 1 and rec.broken
    rec.masked = frozenset({1})
    with pytest.raises(RuntimeError, match="communication timeout"):
        rec.check_error(low_latency=True)
    rec.broken, mem[0] = False, 0
    with pytest.raises(RuntimeError, match="masked"):  # normal mode refuses masked ranks with an empty record too
        rec.check_error()
    assert rec.check_error(low_latency=True) is None and Counting.reads == 1
