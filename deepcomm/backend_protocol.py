"""The contract between Buffer and a backend: what every backend provides (deepcomm/reference: ReferenceBackend;
deepcomm/nvlink/backend.py: CudaBackend, NVLink within a node; deepcomm/internode/backend.py: InternodeBackend, several
nodes). Buffer validates the arguments and numbers the calls, then calls these methods directly, never probing
for them; docs/api.md is the semantics each meets bit for bit."""
from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, Optional, Protocol, Tuple, runtime_checkable

import torch


@dataclass(frozen=True)
class Capabilities:
    """What a backend does itself, so that Buffer does not do it too."""
    x_dtypes: Tuple[torch.dtype, ...]  # dtypes of a non-FP8 x in normal dispatch / combine
    takes_fingerprints: bool  # collective calls take ``fingerprint=`` and the backend has ``reject`` (agreement.py)
    checks_expert_ids_on_device: bool  # a fresh dispatch's expert ids are range-checked by its kernels (no sync)
    checks_low_latency_ids_on_device: bool  # likewise for low-latency dispatch (range and duplicates)
    # get_dispatch_layout's expert ids are range-checked by its kernel, without a host sync: a bad id raises
    # ValueError at the rank's next call on the Buffer or synchronize(), not at once
    checks_layout_ids_on_device: bool = False
    # ``joined_calls`` counts the collective calls whose first exchange this rank has entered (counted as it
    # enters, before anything is sent), over every call kind: a call that raised with the count unchanged never
    # joined its exchange, and Buffer rejects it (``reject``) so that the other ranks raise instead of waiting
    counts_joined_calls: bool = False
    # the most ranks its low-latency mode serves (0: any number); a low-latency call of a larger group raises
    # ValueError in Buffer on every rank before anything is exchanged
    max_low_latency_ranks: int = 0
    # plain calls (a dispatch without a route-only mask, num_worst_tokens, previous_event or async_finish, and a
    # cached one without topk_idx; a combine without previous_event or async_finish) may be checked and read by the
    # backend's ``arg_reader`` (None where it has none: deepcomm/cuda/arg_reader.py), whose methods return None
    # (Buffer then checks in Python) or what ``dispatch_read(read, num_experts, expert_alignment, handle)`` and
    # ``combine_read(read, handle)`` take; its checks are Buffer's (deepcomm/validation.py), its words agreement's
    reads_plain_calls: bool = False
    # the collective calls (Buffer method names) it can run while the current CUDA stream is being captured into a
    # graph (a fresh dispatch only with num_worst_tokens, which Buffer checks); another one raises RuntimeError in
    # Buffer before it is numbered, on every rank of the capture alike, instead of failing inside the capture
    capturable: FrozenSet[str] = frozenset()


@runtime_checkable
class Backend(Protocol):
    name: str
    capabilities: Capabilities

    # ---- normal mode ----
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int): ...
    def dispatch(self, x, topk_idx, topk_weights, num_experts, handle, expert_alignment, num_worst_tokens=0,
                 previous_event=None, async_finish=False, **agreed): ...
    def combine(self, x, handle, topk_weights, previous_event=None, async_finish=False, use_fp8=False,
                **agreed): ...
    @property
    def event(self) -> Optional[torch.cuda.Event]: ...  # the end of the last call (None where calls are synchronous)
    # why the Buffer takes no more calls where a call failed inside its crossing into the extension (None otherwise)
    broken_reason: Optional[str]

    # ---- low-latency mode ----
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, use_ue8m0,
                             return_recv_hook, **agreed): ...
    def low_latency_combine(self, x, topk_idx, topk_weights, handle, return_recv_hook, use_fp8=False,
                            **agreed): ...
    def low_latency_buffer_info(self) -> dict: ...

    # ---- masking lost ranks (low-latency mode) ----
    @property
    def masked(self) -> frozenset: ...
    def mask_ranks(self, ranks: frozenset) -> None: ...
    def unmask_ranks(self) -> None: ...

    # ---- agreement, settings, lifetime ----
    def reject(self, fingerprint, handle=None) -> None: ...  # handle: the rejected call's handle argument, if any
    def set_num_sms(self, num_sms: int) -> None: ...
    def size_bytes(self) -> int: ...
    def synchronize(self) -> None: ...
    def destroy(self) -> None: ...
