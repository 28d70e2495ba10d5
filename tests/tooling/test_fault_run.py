"""The GPU fault tests' runner (tests/helpers/fault_run.py) itself, on CPU processes (gloo): it accepts a rank that dies
as planned, and fails on a survivor's exception, on a hang, and on a rank that was to die but did not."""
import time

import pytest

from tests.helpers.fault_run import die, run_with_faults


def _rank1_dies(rank, world):
    if rank == 1:
        die()
    time.sleep(0.5)  # the survivor outlives the death and ends cleanly without any collective


def _rank0_raises(rank, world):
    if rank == 0:
        raise ValueError("the survivor's check failed")


def _rank0_hangs(rank, world):
    if rank == 0:
        time.sleep(600)


def _nobody_dies(rank, world):
    return None


def test_planned_death_passes():
    run_with_faults(_rank1_dies, 2, killed=(1,), deadline_s=60, device="cpu")


def test_survivor_exception_fails_with_its_traceback():
    with pytest.raises(AssertionError, match="the survivor's check failed"):
        run_with_faults(_rank0_raises, 2, deadline_s=60, device="cpu")


def test_hang_is_killed_and_fails():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 0 was still running after 15"):
        run_with_faults(_rank0_hangs, 2, deadline_s=15, device="cpu")
    assert time.monotonic() - start < 300, "the deadline did not stop the hung rank"


def test_rank_that_should_die_but_finishes_fails():
    with pytest.raises(AssertionError, match="rank 1 was to be killed"):
        run_with_faults(_nobody_dies, 2, killed=(1,), deadline_s=60, device="cpu")
