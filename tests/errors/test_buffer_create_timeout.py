"""Building a Buffer is bounded by timeout_s: a rank that never builds its Buffer is named in a CommTimeoutError
(stage buffer:create) on the others, instead of a collective that waits for torch.distributed's own timeout; and
settings that must agree across ranks (sizes of the shared buffers, ...) are compared there too: ValueError naming
the first that differs, on every rank."""
from __future__ import annotations

import os
import time

import torch.distributed as dist

from tests.helpers.multiproc import run_ranks


def _one_rank_stays_away(rank, world, absent):
    import deepcomm
    from deepcomm.errors import CommTimeoutError
    first = deepcomm.Buffer(backend="reference", hidden=128, max_tokens_per_rank=8, timeout_s=5.0)  # all arrive
    first.destroy()
    outcome = "absent"
    if rank != absent:
        t0 = time.monotonic()
        try:
            deepcomm.Buffer(backend="reference", hidden=128, max_tokens_per_rank=8, timeout_s=1.5)
            outcome = "built"
        except CommTimeoutError as e:
            took = time.monotonic() - t0
            assert e.rank == rank and e.peer == absent and e.stage == "buffer:create", (e.rank, e.peer, e.stage)
            assert f"ranks [{absent}]" in str(e), str(e)
            assert 1.4 < took < 10.0, took
            outcome = "timed out"
    dist.barrier()  # the group is still usable: no collective had started
    # the next Buffer of the group is counted on every rank alike: the absent rank's late mark is for the Buffer it
    # skipped, so this one needs a fresh mark from everyone, and everyone arrives
    if rank == absent:
        deepcomm.Buffer(backend="reference", hidden=128, max_tokens_per_rank=8, timeout_s=5.0).destroy()
    again = deepcomm.Buffer(backend="reference", hidden=128, max_tokens_per_rank=8, timeout_s=5.0)
    again.destroy()
    return outcome


def test_rank_that_never_builds_is_named():
    assert run_ranks(_one_rank_stays_away, 3, 2, timeout=60) == ["timed out", "timed out", "absent"]


def _settings_differ(rank, world):
    import deepcomm
    outcomes = []
    for name, mine in (("hidden", 128 if rank == 0 else 256), ("max_tokens_per_rank", 8 + (rank == 1))):
        kw = dict(backend="reference", hidden=128, max_tokens_per_rank=8, timeout_s=5.0)
        kw[name] = mine
        try:
            deepcomm.Buffer(**kw).destroy()
            outcomes.append("built")
        except ValueError as e:  # every rank sees the same marks and refuses alike, before any collective
            assert str(e).startswith(name + ":") and "rank 1" in str(e), str(e)
            outcomes.append(name)
    os.environ["DEEPCOMM_INTERNODE_KERNELS"] = "0" if rank == 1 else "1"  # kernels on one rank, torch routing
    try:
        deepcomm.Buffer(backend="reference", hidden=128, max_tokens_per_rank=8, timeout_s=5.0).destroy()
        outcomes.append("built")
    except ValueError as e:
        assert str(e).startswith("DEEPCOMM_INTERNODE_KERNELS:") and "rank 1" in str(e), str(e)
        outcomes.append("DEEPCOMM_INTERNODE_KERNELS")
    del os.environ["DEEPCOMM_INTERNODE_KERNELS"]
    dist.barrier()
    deepcomm.Buffer(backend="reference", hidden=128, max_tokens_per_rank=8, timeout_s=5.0).destroy()
    return outcomes


def test_settings_that_differ_between_ranks_are_named():
    assert run_ranks(_settings_differ, 2, timeout=60) == [["hidden", "max_tokens_per_rank",
                                                           "DEEPCOMM_INTERNODE_KERNELS"]] * 2
