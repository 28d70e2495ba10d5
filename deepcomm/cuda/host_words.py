"""A bounded host exchange of a call's words, for the one low-latency call that has no device buffer to meet its
peers in yet (the call that makes or remakes the low-latency buffer, deepcomm/cuda/ll_calls.py).

Every rank publishes its words in the process group's key-value store and waits at most ``timeout_s`` for the
others'; a rank that is somewhere else (another call, gone) is named in a CommTimeoutError with stage
``low_latency:buffer`` instead of the wait lasting as long as the process group's own timeout, as a collective's
would. Keys: ``deepcomm/ll-words/<group ranks>/<exchanger number>/<n>/<rank>``; the exchangers of a group are
numbered in the order they are made (every rank makes its Buffers in the same order), and a rank removes its key of
exchange n - 2 when it publishes exchange n (every rank has read it by then). Where no store is reachable, a
collective gather of the words does it.
"""
from __future__ import annotations

import json
from typing import Dict, List, Sequence, Tuple

import torch.distributed as dist

from ..rendezvous import default_store, wait_for_marks

STAGE = "low_latency:buffer"
_made: Dict[Tuple[int, ...], int] = {}


class HostWords:
    def __init__(self, group, rank: int, world_size: int):
        self.group, self.rank, self.world_size = group, rank, world_size
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(world_size))
        number = _made.get(ranks, 0)
        _made[ranks] = number + 1
        self.prefix = f"deepcomm/ll-words/{','.join(map(str, ranks))}/{number}"
        self.exchanges = 0

    def gather(self, words: Sequence[int], timeout_s: float) -> List[List[int]]:
        """Every rank's ``words``, in rank order."""
        store = default_store()
        if store is None:
            rows = [None] * self.world_size
            dist.all_gather_object(rows, list(words), group=self.group)
            return rows
        self.exchanges += 1
        n = self.exchanges
        keys = [f"{self.prefix}/{n}/{r}" for r in range(self.world_size)]
        store.set(keys[self.rank], json.dumps([int(w) for w in words]))
        if n > 2:
            store.delete_key(f"{self.prefix}/{n - 2}/{self.rank}")
        wait_for_marks(store, keys, timeout_s, self.rank, STAGE,
                       f"did not make the call that makes the low-latency buffer (exchange #{n})")
        return [json.loads(store.get(k)) for k in keys]
