"""ReferenceBackend: the contract of docs/api.md on torch.distributed collectives (gloo on CPU, NCCL on GPU).

Clear rather than fast: it is the oracle the CUDA backend is tested against. Inputs arrive validated by
Buffer; this class does no checking of its own, but compares every call's fingerprint across ranks (the
``fingerprint`` argument of each collective call, and ``reject``; deepcomm/agreement.py) before any row moves.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import agreement, layout
from ..backend_protocol import Capabilities
from ..config import Config
from ..dispatch_rows import pad_to_worst
from . import low_latency, normal
from .collectives import Comm, own_gloo_group_maker


class ReferenceBackend:
    """Backend interface shared with ``deepcomm.nvlink.backend.CudaBackend``."""

    name = "reference"
    # any floating x in normal mode; the collective calls take ``fingerprint=`` and the backend has ``reject``;
    # expert ids are checked by Buffer (reading them here is cheap anyway)
    capabilities = Capabilities(x_dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64),
                                takes_fingerprints=True, checks_expert_ids_on_device=False,
                                checks_low_latency_ids_on_device=False, counts_joined_calls=True)
    event = None  # every call has finished when it returns

    def __init__(self, group, config: Config, rank: int, world_size: int, device: torch.device,
                 buffer_number: Optional[int] = None):
        """``buffer_number``: the Buffer's number in its group (the same on every rank), which keys the gloo group
        of the Buffer's own (collectives.own_gloo_group_maker) on a CPU gloo group; None: the collectives use
        ``group``."""
        self.config = config
        make_own = (own_gloo_group_maker(group, f"b{buffer_number}", rank, world_size, config.timeout_s)
                    if buffer_number is not None and device.type == "cpu" else None)
        self.comm = Comm(group, rank, world_size, device, config.timeout_s, make_own_group=make_own)
        self.masked: frozenset = frozenset()

    # no call of this backend fails after its first exchange began without every rank raising (no extension)
    broken_reason: Optional[str] = None

    @property
    def joined_calls(self) -> int:
        """Calls whose first exchange (Comm.agree, every call kind's) this rank has entered."""
        return self.comm.joined if self.comm is not None else 0

    def reject(self, fingerprint, handle=None) -> None:
        """This rank's own validation rejected its call (``fingerprint``'s REJECTED word says why): take part in the
        call's first exchange all the same, so the other ranks raise naming this rank; the caller raises its own
        error after. Nothing to exchange with once a timeout broke the Buffer (its next call says so). ``handle``
        (the call's handle argument) changes nothing here: every call's first exchange is the same all_gather."""
        if self.comm is None or self.comm.broken:
            return
        op = agreement.OP_NAMES[fingerprint[agreement.Word.OP]]
        self.comm.agree(fingerprint, "dispatch:counts" if op == "dispatch" else f"{op}:agree")

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
        self.comm.check_usable()
        dist.barrier(group=self.comm.group)  # collective on every backend, like the CUDA one
        self.masked = frozenset()

    def get_dispatch_layout(self, topk_idx, num_experts):
        return layout.get_dispatch_layout(topk_idx, num_experts, self.comm.world_size)

    # previous_event / async_finish: the collectives here finish before the call returns, so there is
    # nothing to overlap; the arguments are accepted so code runs unchanged on both backends.
    def dispatch(self, x, topk_idx, topk_weights, num_experts, handle, expert_alignment, num_worst_tokens=0,
                 previous_event=None, async_finish=False, fingerprint=None):
        self.comm.check_usable()
        if handle is not None and torch.is_tensor(handle.num_recv_tokens_per_expert):
            num_worst_tokens = handle.num_recv  # a worst-case handle keeps its padded size
        out = normal.dispatch(self.comm, x, topk_idx, topk_weights, num_experts, handle, expert_alignment,
                              fingerprint)
        return pad_to_worst(out, num_worst_tokens, handle is not None) if num_worst_tokens else out

    def combine(self, x, handle, topk_weights, previous_event=None, async_finish=False, use_fp8=False,
                fingerprint=None):
        self.comm.check_usable()
        return normal.combine(self.comm, x, handle, topk_weights, use_fp8, self.config.gpus_per_node, fingerprint)

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                             use_ue8m0, return_recv_hook, fingerprint=None):
        self.comm.check_usable()
        topk_idx = self._without_masked(topk_idx, num_experts)
        return low_latency.dispatch(self.comm, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                    use_fp8, use_ue8m0, return_recv_hook, fingerprint)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, return_recv_hook, use_fp8=False,
                            fingerprint=None):
        self.comm.check_usable()
        topk_idx = self._without_masked(topk_idx, handle.num_experts)
        return low_latency.combine(self.comm, x, topk_idx, topk_weights, handle, return_recv_hook, use_fp8,
                                   fingerprint)

    def low_latency_buffer_info(self) -> dict:
        """No low-latency buffer: every exchange allocates what it needs."""
        return {"memory": None, "bytes": 0}

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
