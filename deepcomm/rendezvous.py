"""A bounded arrival check before a Buffer's first collective.

Building a Buffer runs collectives (handle exchanges, barriers) that wait for every rank of the group without
deepcomm's timeout: if one rank never builds its Buffer (it crashed, or took another code path), the others would
wait for torch.distributed's own timeout (minutes) with no word of who is missing. So each rank first marks its
arrival in the process group's key-value store and waits, at most ``timeout_s``, for every other rank's mark; a
rank that is not there by then is named in a :class:`CommTimeoutError` (stage ``buffer:create``). Once everyone
has arrived the collectives start with every rank present.

Marks are keyed by the group's ranks and a per-group count of Buffers built, which every rank advances in the
same order (building a Buffer is collective). Where no store is reachable (an unusual init), the check is skipped.
"""
from __future__ import annotations

import datetime
from typing import Dict, Tuple

import torch.distributed as dist

from .errors import CommTimeoutError

STAGE = "buffer:create"
_built: Dict[Tuple[int, ...], int] = {}


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def wait_for_group(group, rank: int, timeout_s: float) -> None:
    """Return once every rank of ``group`` has called this for the same Buffer; raise CommTimeoutError naming the
    first missing rank (group-local) after ``timeout_s``."""
    store = _store()
    if store is None:
        return
    ranks = tuple(dist.get_process_group_ranks(group))
    n = _built.get(ranks, 0)
    _built[ranks] = n + 1
    prefix = f"deepcomm/{STAGE}/{','.join(map(str, ranks))}/{n}"
    keys = [f"{prefix}/{r}" for r in range(len(ranks))]
    store.set(keys[rank], "1")
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:  # DistStoreError (a RuntimeError) on timeout
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if not missing:
            return  # everyone arrived just as the wait gave up
        raise CommTimeoutError(rank, missing[0], STAGE,
                               f"ranks {missing} did not build their Buffer within {timeout_s:g} s") from e
