"""torch.distributed collectives for the reference backend, with a timeout on every wait.

Payloads travel as uint8 byte rows, so every dtype (bf16, fp8, int32, bool...) works on every process-group
backend (gloo has no fp8) and all the per-row fields of one exchange go in a single all_to_all.
"""
from __future__ import annotations

import datetime
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import agreement
from ..dispatch_rows import as_byte_rows, part_row_bytes, unpack_rows
from ..errors import CommTimeoutError


class Comm:
    """One process group, this rank's place in it, and the wait timeout.

    ``make_own_group``: makes a gloo process group of this communicator alone (``own_gloo_group_maker``), called
    through its own methods; the collectives then run there instead of on ``group``. A wait that timed out leaves
    its collective pending in its group, where it would pair with the peers' next one; in a group of its own nothing
    else pairs with it, and a rebuilt Buffer gets a fresh group. It is made at the first collective (making it is
    collective: a Buffer that one rank builds but never calls leaves no group for the others to wait for). After a
    timeout ``broken`` is set: every later call raises (``check_usable``)."""

    def __init__(self, group, rank: int, world_size: int, device: torch.device, timeout_s: float,
                 make_own_group: Optional[Callable[[], object]] = None):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout_s = timeout_s
        self._make_own_group = make_own_group
        self.own_group = None
        self.broken = False
        self.joined = 0  # calls' first exchanges entered (agree): ReferenceBackend.joined_calls

    def _own(self, stage: str):
        """The group of our own (made now if not yet), or None."""
        if self._make_own_group is not None:
            make, self._make_own_group = self._make_own_group, None
            try:
                self.own_group = make()
            except RuntimeError as exc:  # a peer that never makes its first call on this Buffer
                self.broken = True
                if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                    raise CommTimeoutError(self.rank, None, stage, str(exc).splitlines()[0]) from exc
                raise
        return self.own_group

    def check_usable(self) -> None:
        if self.broken:
            raise RuntimeError("deepcomm: this Buffer had a communication timeout; destroy it and build a new one on "
                               "every rank")

    def wait(self, work, stage: str) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                self.broken = True
                raise CommTimeoutError(self.rank, None, stage, str(exc).splitlines()[0]) from exc
            raise

    def all_gather(self, t: torch.Tensor, stage: str) -> torch.Tensor:
        """``[R, *t.shape]``: every rank's ``t``, in rank order."""
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        if self._own(stage) is not None:
            work = self.own_group.allgather([out], [t])
        else:
            work = dist.all_gather(out, t, group=self.group, async_op=True)
        self.wait(work, stage)
        return torch.stack(out)

    def agree(self, fingerprint: Optional[agreement.Fingerprint], stage: str,
              counts: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """A call's first exchange: one all_gather of a fixed size, ``agreement.WORDS + R`` int32 words, so that it
        pairs safely whatever the ranks' calls are (gloo aborts the process on collectives of mismatched sizes):
        this rank's fingerprint, then ``counts`` (``[R]``, a fresh dispatch's rows per destination rank; zeros for
        other calls). Raises ValueError (``agreement.check``) unless every rank made the same call, except on a rank
        whose own fingerprint is rejected (it raises its own error after this). Returns the ``[R, R]`` counts.

        ``fingerprint`` None (a caller without a Buffer): only ``counts`` are gathered, as ``[R, R]``, and None is
        returned when there are none."""
        R = self.world_size
        if fingerprint is None:
            return None if counts is None else self.all_gather(counts.to(torch.int32), stage)
        self.joined += 1
        head = torch.zeros(agreement.WORDS + R, dtype=torch.int32)
        head[:agreement.WORDS] = torch.tensor(fingerprint, dtype=torch.int32)
        if counts is not None:
            head[agreement.WORDS:] = counts.cpu()
        every = self.all_gather(head.to(self.device), stage)
        if not fingerprint[agreement.Word.REJECTED]:
            agreement.check(every[:, :agreement.WORDS].tolist())
        return every[:, agreement.WORDS:].contiguous()

    def exchange_rows(self, parts: Sequence[torch.Tensor], send_counts: Sequence[int],
                      recv_counts: Sequence[int], stage: str) -> "PendingRows":
        """Start an all_to_all of row-aligned tensors.

        ``parts`` all have ``sum(send_counts)`` rows, grouped by destination rank ascending; the result has
        ``sum(recv_counts)`` rows grouped by source rank ascending, one tensor per part (same dtype and
        trailing shape). Call ``.wait()`` on the returned object for the tensors.
        """
        num_send = sum(send_counts)
        row_bytes = [part_row_bytes(p) for p in parts]
        packed = torch.cat([as_byte_rows(p, num_send, b) for p, b in zip(parts, row_bytes)], dim=1)
        out = torch.empty(sum(recv_counts), sum(row_bytes), dtype=torch.uint8, device=self.device)
        if self._own(stage) is not None:
            work = self.own_group.alltoall_base(out, packed.contiguous(), list(recv_counts), list(send_counts))
        else:
            work = dist.all_to_all_single(out, packed.contiguous(), output_split_sizes=list(recv_counts),
                                          input_split_sizes=list(send_counts), group=self.group, async_op=True)

        def unpack() -> List[torch.Tensor]:
            self.wait(work, stage)
            return unpack_rows(out, parts, row_bytes)

        return PendingRows(unpack)


def own_gloo_group_maker(group, key: str, rank: int, world_size: int,
                         timeout_s: float) -> Optional[Callable[[], object]]:
    """What makes a gloo process group over the ranks of ``group`` for one Buffer, met through the default store
    under ``key`` (the same on every rank; making it is collective), or None where ``group`` is not a gloo group or
    no store is reachable. The group is not registered with torch.distributed: call its methods."""
    from ..rendezvous import default_store
    store = default_store()
    if store is None or "gloo" not in str(dist.get_backend(group)).lower():
        return None
    prefix = f"deepcomm/reference/{','.join(map(str, dist.get_process_group_ranks(group)))}/{key}/"
    return lambda: dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size,
                                         datetime.timedelta(seconds=timeout_s))


class PendingRows:
    """Result of ``Comm.exchange_rows``; ``wait()`` blocks (up to the timeout) and returns the tensors."""

    def __init__(self, unpack: Callable[[], List[torch.Tensor]]):
        self._unpack = unpack
        self._result: Optional[List[torch.Tensor]] = None

    def wait(self) -> List[torch.Tensor]:
        if self._result is None:
            self._result = self._unpack()
        return self._result
