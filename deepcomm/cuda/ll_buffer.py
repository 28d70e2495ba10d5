"""A rank's low-latency buffer (csrc/runtime/ll_layout.hpp): made at the first low-latency call of a shape,
mapped into every rank, sharing the NVLink buffer's error record and timeout."""
from __future__ import annotations

import torch

from .arena import as_device_bytes
from .peer_memory import PeerMemory

TOPK_MAX = 32


class LlBuffer:
    def __init__(self, C, group, rank: int, world_size: int, device: torch.device, num_experts: int,
                 max_tokens: int, hidden: int, err_dev: int, timeout_ns: int):
        self.key = (num_experts, max_tokens, hidden)
        self.ctx = C.LlContext(rank, world_size, num_experts, max_tokens, hidden, TOPK_MAX)
        self.layout = self.ctx.layout()
        self.memory = PeerMemory(C, group, rank, world_size, self.layout["total"])
        for r, p in enumerate(self.memory.peer_ptrs):
            self.ctx.set_peer(r, p)
        self.ctx.set_error_record(err_dev)
        self.ctx.set_timeout_ns(timeout_ns)
        # One uint8 view of our whole buffer; receive tensors are slices of it (valid until the slot is reused).
        self.bytes = as_device_bytes(self.memory.ptr, self.layout["total"], device)
        self.calls = 0

    def receive_views(self, slot: int, use_fp8: bool, num_local: int, rows: int, hidden: int):
        """``recv_x`` of one slot: bf16 ``[L, rows, H]``, or (e4m3 ``[L, rows, H]``, fp32 ``[L, rows, H/128]``)."""
        x0 = self.layout["recv_x_slot"][slot]
        if not use_fp8:
            return self.bytes[x0:x0 + num_local * rows * hidden * 2].view(torch.bfloat16).view(num_local, rows, hidden)
        s0 = self.layout["recv_scales_slot"][slot]
        values = self.bytes[x0:x0 + num_local * rows * hidden].view(torch.float8_e4m3fn).view(num_local, rows, hidden)
        scales = self.bytes[s0:s0 + num_local * rows * hidden // 128 * 4].view(torch.float32)
        return values, scales.view(num_local, rows, hidden // 128)

    def close(self) -> None:
        self.bytes = None
        self.memory.close()
