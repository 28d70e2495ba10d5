"""ReferenceBackend: the contract of docs/api.md on torch.distributed collectives (gloo on CPU, NCCL on GPU).

Clear rather than fast: it is the oracle the CUDA backend is tested against. Inputs arrive validated by
Buffer; this class does no checking of its own.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import layout
from ..config import Config
from . import low_latency, normal
from .collectives import Comm


class ReferenceBackend:
    """Backend interface shared with ``deepcomm.cuda.backend.CudaBackend``."""

    name = "reference"
    # dtypes accepted for the non-FP8 ``x`` of normal dispatch/combine
    x_dtypes = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

    def __init__(self, group, config: Config, rank: int, world_size: int, device: torch.device):
        self.config = config
        self.comm = Comm(group, rank, world_size, device, config.timeout_s)
        self.masked: frozenset = frozenset()

    def _without_masked(self, topk_idx, num_experts):
        """Low-latency mode without masked ranks: slots naming their experts count as -1. (Here every rank is
        alive and runs the collectives; masks must agree among the unmasked ranks, as on the CUDA backend.)"""
        if not self.masked:
            return topk_idx
        owner = topk_idx.clamp(min=0) // (num_experts // self.comm.world_size)
        gone = torch.zeros_like(topk_idx, dtype=torch.bool)
        for r in self.masked:
            gone |= owner == r
        return torch.where(gone, torch.full_like(topk_idx, -1), topk_idx)

    def mask_ranks(self, ranks: frozenset) -> None:
        self.masked = self.masked | ranks

    def unmask_ranks(self) -> None:
        dist.barrier(group=self.comm.group)  # collective on every backend, like the CUDA one
        self.masked = frozenset()

    def get_dispatch_layout(self, topk_idx, num_experts):
        return layout.get_dispatch_layout(topk_idx, num_experts, self.comm.world_size)

    # previous_event / async_finish: the collectives here finish before the call returns, so there is
    # nothing to overlap; the arguments are accepted so code runs unchanged on both backends.
    def dispatch(self, x, topk_idx, topk_weights, num_experts, handle, expert_alignment, num_worst_tokens=0,
                 previous_event=None, async_finish=False):
        if handle is not None and torch.is_tensor(handle.num_recv_tokens_per_expert):
            num_worst_tokens = handle.num_recv  # a worst-case handle keeps its padded size
        out = normal.dispatch(self.comm, x, topk_idx, topk_weights, num_experts, handle, expert_alignment)
        return normal.pad_to_worst(out, num_worst_tokens, handle is not None) if num_worst_tokens else out

    def combine(self, x, handle, topk_weights, previous_event=None, async_finish=False, use_fp8=False):
        return normal.combine(self.comm, x, handle, topk_weights, use_fp8, self.config.gpus_per_node)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                             use_ue8m0, return_recv_hook):
        topk_idx = self._without_masked(topk_idx, num_experts)
        return low_latency.dispatch(self.comm, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                    use_fp8, use_ue8m0, return_recv_hook)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, return_recv_hook, use_fp8=False):
        topk_idx = self._without_masked(topk_idx, handle.num_experts)
        return low_latency.combine(self.comm, x, topk_idx, topk_weights, handle, return_recv_hook, use_fp8)

    def set_num_sms(self, num_sms: int) -> None:
        # Recorded in the Buffer's Config; collectives have no SM budget to apply it to.
        return None

    def size_bytes(self) -> int:
        # No persistent communication buffers: every exchange allocates what it needs.
        return 0

    def synchronize(self) -> None:
        if self.comm.device.type == "cuda":
            torch.cuda.synchronize(self.comm.device)

    def destroy(self) -> None:
        self.comm = None
