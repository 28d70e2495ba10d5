"""A rank's low-latency buffer (csrc/runtime/ll_layout.hpp): made at the first low-latency call of a shape,
mapped into every rank, sharing the NVLink buffer's error record and timeout. Its memory is a CUDA IPC allocation
(``memory="ipc"``) or a block of NVSHMEM's symmetric heap (``"nvshmem"``); the kernels see peer pointers either way.

Everything a dispatch returns (recv_x, recv_count and the handle's tensors) is a view of this buffer, made once
per slot and handed out again on every call: valid until the same slot is used again two dispatches later."""
from __future__ import annotations

import os
from typing import Dict, Tuple

import torch

from .arena import as_device_bytes
from .nvshmem_memory import NvshmemMemory
from .peer_memory import PeerMemory

TOPK_MAX = 32
TRACE_POINTS = 10  # kLlTracePoints
MEMORY = {"ipc": PeerMemory, "nvshmem": NvshmemMemory}  # deepcomm.config.LL_MEMORY_KINDS


class LlBuffer:
    def __init__(self, C, group, rank: int, world_size: int, device: torch.device, num_experts: int,
                 max_tokens: int, hidden: int, err_dev: int, timeout_ns: int, memory: str = "ipc"):
        self.key = (num_experts, max_tokens, hidden)
        self.ctx = C.LlContext(rank, world_size, num_experts, max_tokens, hidden, TOPK_MAX)
        self.layout = self.ctx.layout()
        self.memory = MEMORY[memory](C, group, rank, world_size, self.layout["total"])
        for r, p in enumerate(self.memory.peer_ptrs):
            self.ctx.set_peer(r, p)
        self.ctx.set_error_record(err_dev)
        self.ctx.set_timeout_ns(timeout_ns)
        self.bytes = as_device_bytes(self.memory.ptr, self.layout["total"], device)
        # diagnostics: per-block timer stamps of the latest call (csrc/kernels/ll_common.cuh, LlTracePoint)
        self.trace = None
        if os.environ.get("DEEPCOMM_LL_TRACE") == "1":
            self.trace = torch.zeros(C.MAX_BLOCKS, TRACE_POINTS, dtype=torch.int64, device=device)
            self.ctx.set_trace(self.trace.data_ptr())
        self.calls = 0
        self.world_size = world_size
        L, R, M, H = num_experts // world_size, world_size, max_tokens, hidden
        self._recv_pos: Dict[Tuple[int, int, int], torch.Tensor] = {}
        self._slots = []
        for slot in range(2):
            x0 = self.layout["recv_x_slot"][slot]
            s0 = self.layout["recv_scales_slot"][slot]
            bf16 = self._view(x0, L * R * M * H * 2, torch.bfloat16).view(L, R * M, H)
            fp8 = (self._view(x0, L * R * M * H, torch.float8_e4m3fn).view(L, R * M, H),
                   self._view(s0, L * R * M * (H // 128) * 4, torch.float32).view(L, R * M, H // 128))
            self._slots.append(dict(
                bf16=bf16, fp8=fp8,
                count=self._view(self.layout["out_count_slot"][slot], L * 4, torch.int32),
                layout=self._view(self.layout["out_layout_slot"][slot], L * R * 8, torch.int32).view(L, R, 2),
                src_info=self._view(self.layout["out_src_info_slot"][slot], L * R * M * 4, torch.int32).view(L, R * M),
            ))

    def _view(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self.bytes[offset:offset + nbytes].view(dtype)

    def outputs(self, slot: int, use_fp8: bool):
        """``(recv_x, recv_count, layout, src_info)`` of one slot."""
        s = self._slots[slot]
        return (s["fp8"] if use_fp8 else s["bf16"]), s["count"], s["layout"], s["src_info"]

    def recv_pos(self, slot: int, num_tokens: int, topk: int) -> torch.Tensor:
        key = (slot, num_tokens, topk)
        view = self._recv_pos.get(key)
        if view is None:
            view = self._view(self.layout["out_recv_pos_slot"][slot], num_tokens * topk * 4,
                              torch.int32).view(num_tokens, topk)
            self._recv_pos[key] = view
        return view

    def write_mask(self, masked) -> None:
        """Ranks the kernels leave out (csrc/runtime/ll_layout.hpp "mask"), on the current stream."""
        flags = [1 if r in masked else 0 for r in range(self.world_size)]
        self._view(self.layout["mask"], 4 * self.world_size, torch.int32).copy_(
            torch.tensor(flags, dtype=torch.int32), non_blocking=False)

    def reset_signals(self) -> None:
        """Zero the call numbers, counters and flags (and the mask): every rank at once, with no kernel running."""
        self.bytes[:self.layout["signal_bytes"]].zero_()
        self.calls = 0

    def close(self) -> None:
        self._slots = []
        self._recv_pos.clear()
        self.bytes = None
        self.memory.close()
