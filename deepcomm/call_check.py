"""Opt-in check that every rank makes the same collective call with the same call-wide arguments.

The kernels assume that every rank of a Buffer calls ``dispatch``, ``combine``, ``low_latency_dispatch`` and
``low_latency_combine`` in the same order, and that the arguments that shape the call (hidden size, dtype, top-k,
FP8 or not, cached handle or not, ...) agree; only the token count may differ per rank. A rank that calls
``combine`` while another calls ``dispatch``, or passes another ``K``, makes the kernels wait for data that never
comes (a ``CommTimeoutError`` after ``timeout_s``) or read rows laid out differently. With
``Buffer(check_calls=True)`` (or ``DEEPCOMM_CHECK_CALLS=1``) each such call first publishes its signature in the
process group's key-value store and waits, at most ``timeout_s``, for every rank's: a mismatch raises ``ValueError``
on every rank naming the call and the argument, before any kernel runs; a rank whose own validation failed makes
the others raise too, naming it. Each call costs a round trip through the store, so this is a debugging aid, off by
default.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional

import torch.distributed as dist

from .rendezvous import check_same, wait_for_marks

ENV = "DEEPCOMM_CHECK_CALLS"


def resolve_check_calls(value: Optional[bool]) -> bool:
    """``value`` when given (a bool), else ``$DEEPCOMM_CHECK_CALLS`` ("1"/"0", "true"/"false"), else off."""
    if value is not None:
        if not isinstance(value, bool):
            raise ValueError(f"check_calls: expected a bool or None, got {type(value).__name__}")
        return value
    env = os.environ.get(ENV, "").strip().lower()
    if env in ("", "0", "false", "no", "off"):
        return False
    if env in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ENV}: expected 1 or 0, got {os.environ[ENV]!r}")


class CallChecker:
    """One Buffer's sequence of checked calls. Keys: ``deepcomm/call/<buffer key>/<n>/<rank>``; a rank removes its
    key of call n - 2 when it publishes call n (every rank has read it by then: it could not have published call
    n - 1 before reading n - 2)."""

    def __init__(self, store, group, rank: int, world_size: int, timeout_s: float, buffer_key: str):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.prefix = f"deepcomm/call/{','.join(map(str, dist.get_process_group_ranks(group)))}/{buffer_key}"
        self.calls = 0

    def _key(self, n: int, rank: int) -> str:
        return f"{self.prefix}/{n}/{rank}"

    def agree(self, op: str, fields: Dict[str, object], error: Optional[str] = None) -> None:
        """Publish this rank's call ``op`` (its ``fields``, or the ``error`` its own validation raised) and compare
        with every rank's. Raises ValueError on a mismatch or another rank's error, CommTimeoutError when a rank does
        not make its call within ``timeout_s``."""
        self.calls += 1
        n = self.calls
        self.store.set(self._key(n, self.rank), json.dumps({"op": op, "fields": fields, "error": error},
                                                           sort_keys=True))
        if n > 2:
            self.store.delete_key(self._key(n - 2, self.rank))
        keys = [self._key(n, r) for r in range(self.world_size)]
        wait_for_marks(self.store, keys, self.timeout_s, self.rank, f"call:{op}",
                       f"did not make call #{n} on this Buffer (check_calls)")
        if error is not None:
            return  # the caller raises its own error
        every = [json.loads(self.store.get(k)) for k in keys]
        for r, call in enumerate(every):
            if call["error"] is not None:
                raise ValueError(f"rank {r} rejected its {call['op']} (call #{n} on this Buffer): {call['error']}")
        for r, call in enumerate(every):
            if call["op"] != op:
                raise ValueError(f"call order: call #{n} on this Buffer is {op} on rank {self.rank} but "
                                 f"{call['op']} on rank {r}; every rank must make the same calls in the same order")
        check_same(fields, [call["fields"] for call in every], f"for {op} (call #{n} on this Buffer)")
