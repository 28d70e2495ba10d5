"""The GPU tests' runner (tests/helpers/nccl_run.py) itself, on CPU processes (gloo): a rendezvous port that another
process took between choosing it and listening on it starts the run again on a new port; a worker's exception and
a hang still fail the run."""
import socket
import time

import pytest

from tests.helpers import nccl_run


def _fine(rank, world):
    return None


def _rank1_raises(rank, world):
    if rank == 1:
        raise ValueError("the worker's check failed")


def _rank0_hangs(rank, world):
    if rank == 0:
        time.sleep(600)


@pytest.fixture
def busy_port_first(monkeypatch):
    """_free_port returns a port that is already listened on the first time, then free ones."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    first = [held.getsockname()[1]]
    real = nccl_run._free_port
    monkeypatch.setattr(nccl_run, "_free_port", lambda: first.pop() if first else real())
    yield first
    held.close()


def test_port_taken_is_retried(busy_port_first):
    nccl_run.run_on_gpus(_fine, 2, timeout_s=120, device="cpu")
    assert busy_port_first == []  # the busy port was handed out and the run still passed


def test_port_taken_every_time_fails(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    monkeypatch.setattr(nccl_run, "_free_port", lambda: held.getsockname()[1])
    try:
        with pytest.raises(AssertionError, match="rank 0 failed"):
            nccl_run.run_on_gpus(_fine, 2, timeout_s=120, attempts=2, device="cpu")
    finally:
        held.close()


def test_worker_exception_fails():
    with pytest.raises(AssertionError, match="the worker's check failed"):
        nccl_run.run_on_gpus(_rank1_raises, 2, timeout_s=120, device="cpu")


def test_hang_fails():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"did not finish within 15"):
        nccl_run.run_on_gpus(_rank0_hangs, 2, timeout_s=15, device="cpu")
    assert time.monotonic() - start < 60
