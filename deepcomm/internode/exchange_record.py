"""What the internode path's communication objects share. Both transports (NicTransport, NvshmemTransport): who
their peers are, the checks a round's block sizes pass before anything is issued, the views of their send area and
receive slots, the refusal after a timeout. Those and the NVLink hop (NodeLink): the host-mapped error record their
bounded wait kernels fill, and the release of their registered memory."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..errors import CommTimeoutError, crossing_failure_text
from ..cuda.wait_stages import stage_text

# what every call of a Buffer that a timeout broke raises (RecordedWaits.broken_error)
TIMED_OUT = "deepcomm: this Buffer timed out earlier; destroy it and build a new one on every rank"


def peer_list(rank: int, world_size: int, peers: Optional[Sequence[int]]) -> List[int]:
    """``peers`` without ``rank``, ascending (every other rank when None); ValueError for a rank outside the group
    or for no peer at all."""
    out = sorted(set(range(world_size) if peers is None else peers) - {rank})
    if not out or not all(0 <= p < world_size for p in out):
        raise ValueError(f"peers: expected ranks in [0, {world_size}) other than {rank}, got {list(peers or [])}")
    return out


def check_round(send_bytes: Sequence[int], send_begin: Sequence[int], rank: int, world_size: int,
                peers: Sequence[int], slot_bytes: int) -> None:
    """ValueError unless every block of a round fits: one entry per rank, nothing for a rank that is not a peer,
    each peer's block within a receive slot and within the send area (``world_size`` slots)."""
    if len(send_bytes) != world_size or len(send_begin) != world_size:
        raise ValueError(f"send_bytes: expected {world_size} entries (one per rank), got {len(send_bytes)} and "
                         f"{len(send_begin)} begins")
    for p in sorted(set(range(world_size)) - set(peers) - {rank}):
        if send_bytes[p]:
            raise ValueError(f"send_bytes: rank {p} is not a peer of this transport (peers {list(peers)})")
    send_area = world_size * slot_bytes
    for p in peers:
        n, b = int(send_bytes[p]), int(send_begin[p])
        if n > slot_bytes:
            raise ValueError(f"x: {n} bytes for rank {p} exceed the receive slot ({slot_bytes} bytes); raise "
                             "max_tokens_per_rank or hidden of the Buffer")
        if n < 0 or b < 0 or b + n > send_area:
            raise ValueError(f"send_begin: block for rank {p} ([{b}, {b} + {n})) is outside the send area "
                             f"({send_area} bytes)")


class RecordedWaits:
    """Mixin. The owner sets ``C`` (the extension), ``device``, ``err_host`` (0 until allocated), ``broken``,
    ``region`` (its registered memory as bytes) and ``mem`` (its registered memory, with ``close()``)."""
    broken_reason: Optional[str] = None  # why ``broken``, where not a timeout (set_broken_by)

    def broken_error(self) -> RuntimeError:
        """What every call of a broken Buffer raises."""
        return RuntimeError(self.broken_reason or TIMED_OUT)

    def set_broken_by(self, call: str, error: BaseException) -> None:
        """``call`` raised ``error`` inside its crossing into the extension after its exchange began: no more
        calls (the peers may wait for what this rank never sent); each later one raises saying why."""
        if not self.broken:
            self.broken, self.broken_reason = True, crossing_failure_text(call, error)

    def _what(self, seq: int) -> str:
        """Names the step a timeout happened in, for the error's detail."""
        return f"exchange round #{seq}"

    def check_error(self) -> None:
        """Raise CommTimeoutError (rank, peer, stage, step) when one of our waits timed out; the owner then refuses
        further work. No host sync: a look while kernels still run sees only the timeouts recorded so far."""
        if not self.err_host:
            return
        flag, rank, peer, stage, seq, waited_ns = self.C.read_error(self.err_host)
        if flag == 1:  # 2: a waiter is still writing the record (looked at before a sync): the next look sees it
            self.broken = True
            raise CommTimeoutError(rank, None if peer < 0 else peer, stage_text(self.C, stage),
                                   f"{self._what(seq)}, waited {waited_ns / 1e9:.3f} s")

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        if self.err_host:
            self.C.host_mapped_free(self.err_host)
            self.err_host = 0
        self.region = None
        self.mem.close()


class ExchangeRecord(RecordedWaits):
    """Mixin of the transports: besides RecordedWaits' attributes they set ``offsets`` (with "send" and "recv")
    and ``slot_bytes``."""

    def send_view(self, rows: int, stride: int) -> torch.Tensor:
        o = self.offsets["send"]
        return self.region[o:o + rows * stride].view(rows, stride)

    def recv_view(self, src: int, rows: int, stride: int) -> torch.Tensor:
        o = self.offsets["recv"] + src * self.slot_bytes
        return self.region[o:o + rows * stride].view(rows, stride)

    def recv_rows(self, first: int, step: int, count: int, nbytes: int) -> torch.Tensor:
        """uint8 ``[count, nbytes]``: the first ``nbytes`` of the receive slots of sources ``first``, ``first +
        step``, ... (one view, whatever ``count``; a slot no peer wrote holds stale bytes)."""
        o = self.offsets["recv"] + first * self.slot_bytes
        return self.region[o:].as_strided((count, nbytes), (step * self.slot_bytes, 1))

    def refuse_if_broken(self) -> None:
        if self.broken:
            raise self.broken_error()
