"""A queue pair in GPU memory (csrc/transport/device_qp_layout.hpp): send ring, CQ, doorbell records and the
posters' shared counters, plus the mapped-host error record its device waits report to. GPU threads post into it
(csrc/transport/qp_poster.hpp); a device emulated NIC (nic_serve.hpp) or, on a cluster, a ConnectX drains it."""
from __future__ import annotations

from typing import Dict

import torch

from ..errors import CommTimeoutError
from ..cuda.wait_stages import stage_text


class DeviceQueuePair:
    """``log_wqebbs``: the send ring holds 2^log_wqebbs 64-byte WQEBBs (2..15). ``log_cqes``: CQ size, at least
    the ring's so the NIC never finds the CQ full. ``start``: first WQEBB index (tests start near the 16-bit wrap)."""

    def __init__(self, C, device: torch.device, log_wqebbs: int = 6, log_cqes: int | None = None, qpn: int = 0x1234,
                 start: int = 0, timeout_s: float = 10.0, rank: int = 0):
        if not 2 <= log_wqebbs <= 15:
            raise ValueError(f"log_wqebbs must be in [2, 15], got {log_wqebbs}")
        log_cqes = log_wqebbs if log_cqes is None else log_cqes
        if not log_wqebbs <= log_cqes <= 16:
            raise ValueError(f"log_cqes must be in [log_wqebbs={log_wqebbs}, 16], got {log_cqes}")
        if not 0 <= qpn < 1 << 24:
            raise ValueError(f"qpn must fit in 24 bits, got {qpn}")
        if not 0 <= start < 1 << 32:
            raise ValueError(f"start must be a 32-bit index, got {start}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.C, self.T = C, C.transport
        self.device, self.log_wqebbs, self.log_cqes, self.qpn, self.start = device, log_wqebbs, log_cqes, qpn, start
        self.timeout_s, self.rank = timeout_s, rank
        self.layout = self.T.device_qp_layout(log_wqebbs, log_cqes)
        self.memory = torch.empty(self.layout["total"], dtype=torch.uint8, device=device)
        self.seq = torch.zeros(1, dtype=torch.int64, device=device)  # WaitCtx needs a sequence counter
        self.err_host, self.err_dev = C.host_mapped_alloc(C.error_record_bytes())
        C.clear_error(self.err_host)
        self.T.device_qp_init(self.ptr, log_wqebbs, log_cqes, start, torch.cuda.current_stream(device).cuda_stream)

    @property
    def ptr(self) -> int:
        return self.memory.data_ptr()

    @property
    def wqebbs(self) -> int:
        return 1 << self.log_wqebbs

    def _bytes(self, part: str, n: int) -> bytes:
        off = self.layout[part]
        return bytes(self.memory[off:off + n].cpu().numpy().tobytes())

    def ring_bytes(self) -> bytes:
        return self._bytes("ring", self.wqebbs * 64)

    def dbrec_bytes(self) -> bytes:
        return self._bytes("dbrec", 8)

    def doorbell_bytes(self) -> bytes:
        return self._bytes("doorbell", 8)

    def cqe_bytes(self, index: int) -> bytes:
        off = self.layout["cqes"] + (index % (1 << self.log_cqes)) * 64
        return bytes(self.memory[off:off + 64].cpu().numpy().tobytes())

    def _fields(self, part: str) -> Dict[str, int]:
        names = self.layout[part + "_fields"]
        raw = self._bytes(part, 4 * len(names))
        return {n: int.from_bytes(raw[4 * i:4 * i + 4], "little") for i, n in enumerate(names)}

    def poster_state(self) -> Dict[str, int]:
        return self._fields("poster")

    def nic_stats(self) -> Dict[str, int]:
        return self._fields("nic")

    def check_error(self) -> None:
        """Raise CommTimeoutError if a device wait on this queue pair timed out (or saw an error CQE)."""
        flag, rank, peer, stage, seq, waited_ns = self.C.read_error(self.err_host)
        if flag:
            raise CommTimeoutError(rank, None if peer < 0 else peer, stage_text(self.C, stage),
                                   f"waited {waited_ns / 1e9:.3f} s")

    def close(self) -> None:
        if self.err_host:
            torch.cuda.synchronize(self.device)
            self.C.host_mapped_free(self.err_host)
            self.err_host = 0
