"""A bounded arrival check before a Buffer's first collective.

Building a Buffer runs collectives (handle exchanges, barriers) that wait for every rank of the group without
deepcomm's timeout: if one rank never builds its Buffer (it crashed, or took another code path), the others would
wait for torch.distributed's own timeout (minutes) with no word of who is missing. So each rank first marks its
arrival in the process group's key-value store and waits, at most ``timeout_s``, for every other rank's mark; a
rank that is not there by then is named in a :class:`CommTimeoutError` (stage ``buffer:create``). Once everyone
has arrived the collectives start with every rank present.

Marks are keyed by the group's ranks and a per-group count of Buffers built, which every rank advances in the
same order (building a Buffer is collective). Where no store is reachable (an unusual init), the check is skipped.

Each mark carries the rank's Buffer settings that must agree across the group (sizes that lay out the shared
buffers, the block count whose blocks pair up across ranks, ...): settings that differ raise ``ValueError`` naming
the first such setting on every rank, before any collective, instead of peers writing into regions laid out
differently.
"""
from __future__ import annotations

import datetime
import json
from typing import Dict, Optional, Tuple

import torch.distributed as dist

from .errors import CommTimeoutError

STAGE = "buffer:create"
_built: Dict[Tuple[int, ...], int] = {}


def default_store():
    """The process group's key-value store, or None where none is reachable."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def wait_for_group(group, rank: int, timeout_s: float, settings: Optional[Dict[str, object]] = None) -> Optional[int]:
    """Return once every rank of ``group`` has called this for the same Buffer; raise CommTimeoutError naming the
    first missing rank (group-local) after ``timeout_s``, or ValueError naming the first of ``settings`` that is
    not the same on every rank. Returns the Buffer's number in the group (the same on every rank), or None where
    no store is reachable."""
    store = default_store()
    if store is None:
        return None
    ranks = tuple(dist.get_process_group_ranks(group))
    n = _built.get(ranks, 0)
    _built[ranks] = n + 1
    prefix = f"deepcomm/{STAGE}/{','.join(map(str, ranks))}/{n}"
    keys = [f"{prefix}/{r}" for r in range(len(ranks))]
    store.set(keys[rank], json.dumps(settings or {}, sort_keys=True))
    wait_for_marks(store, keys, timeout_s, rank, STAGE, "did not build their Buffer")
    if settings:
        check_same(settings, [json.loads(store.get(k)) for k in keys], "of the group")
    return n


def wait_for_marks(store, keys, timeout_s: float, rank: int, stage: str, what: str) -> None:
    """Wait at most ``timeout_s`` until every key of ``keys`` (one per rank of the group, in rank order) is set;
    otherwise raise CommTimeoutError naming the first missing rank: "ranks [...] <what> within <timeout_s> s"."""
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:  # DistStoreError (a RuntimeError) on timeout
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        if missing:
            raise CommTimeoutError(rank, missing[0], stage, f"ranks {missing} {what} within {timeout_s:g} s") from e


def check_same(mine: Dict[str, object], every: list, where: str) -> None:
    """ValueError naming the first (sorted) of ``mine``'s names whose value differs between the ranks' ``every``
    (dicts in rank order): "<name>: must be the same on every rank <where>; rank 0 has ..., rank r has ..."."""
    for name in sorted(mine):
        values = [marks.get(name) for marks in every]
        odd = next((r for r, v in enumerate(values) if v != values[0]), None)
        if odd is not None:
            raise ValueError(f"{name}: must be the same on every rank {where}; rank 0 has {values[0]!r}, "
                             f"rank {odd} has {values[odd]!r}")
