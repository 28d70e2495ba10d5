"""torch.distributed collectives for the reference backend, with a timeout on every wait.

Payloads travel as uint8 byte rows, so every dtype (bf16, fp8, int32, bool...) works on every process-group
backend (gloo has no fp8) and all the per-row fields of one exchange go in a single all_to_all.
"""
from __future__ import annotations

import datetime
import math
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import CommTimeoutError


class Comm:
    """One process group, this rank's place in it, and the wait timeout."""

    def __init__(self, group, rank: int, world_size: int, device: torch.device, timeout_s: float):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout_s = timeout_s

    def wait(self, work, stage: str) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise CommTimeoutError(self.rank, None, stage, str(exc).splitlines()[0]) from exc
            raise

    def all_gather(self, t: torch.Tensor, stage: str) -> torch.Tensor:
        """``[R, *t.shape]``: every rank's ``t``, in rank order."""
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self.wait(dist.all_gather(out, t, group=self.group, async_op=True), stage)
        return torch.stack(out)

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
        work = dist.all_to_all_single(out, packed.contiguous(), output_split_sizes=list(recv_counts),
                                      input_split_sizes=list(send_counts), group=self.group, async_op=True)

        def unpack() -> List[torch.Tensor]:
            self.wait(work, stage)
            return unpack_rows(out, parts, row_bytes)

        return PendingRows(unpack)


class PendingRows:
    """Result of ``Comm.exchange_rows``; ``wait()`` blocks (up to the timeout) and returns the tensors."""

    def __init__(self, unpack: Callable[[], List[torch.Tensor]]):
        self._unpack = unpack
        self._result: Optional[List[torch.Tensor]] = None

    def wait(self) -> List[torch.Tensor]:
        if self._result is None:
            self._result = self._unpack()
        return self._result


def part_row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row of ``t`` (everything after its first dimension)."""
    return math.prod(t.shape[1:]) * t.element_size()


def as_byte_rows(t: torch.Tensor, rows: int, nbytes: int) -> torch.Tensor:
    """``t`` as uint8 ``[rows, nbytes]``."""
    if t.shape[0] != rows:
        raise RuntimeError(f"exchange_rows: part has {t.shape[0]} rows, expected {rows}")
    return t.contiguous().reshape(-1).view(torch.uint8).reshape(rows, nbytes)


def unpack_rows(out: torch.Tensor, parts: Sequence[torch.Tensor], row_bytes: Sequence[int]) -> List[torch.Tensor]:
    """Split uint8 rows ``out`` (the parts side by side, in order, from byte 0) back into one tensor per part, with
    each part's dtype and trailing shape."""
    tensors, offset = [], 0
    for part, nbytes in zip(parts, row_bytes):
        # flatten before the dtype view: a 1-row slice counts as contiguous but keeps the wide stride
        chunk = out[:, offset:offset + nbytes].contiguous().reshape(-1)
        if chunk.storage_offset() % part.element_size():  # that 1-row view may start mid-element: copy
            chunk = chunk.clone()
        tensors.append(chunk.view(part.dtype).reshape(out.shape[0], *part.shape[1:]))
        offset += nbytes
    return tensors
