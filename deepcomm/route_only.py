"""Route-only normal dispatch: rows go where a ``is_token_in_rank`` mask says; top-k ids and weights optional.

``Buffer.dispatch(x, is_token_in_rank=mask, ...)`` without a handle lands here. Every backend runs it through the
two calls it already has, so no kernel knows about it:

1. a fresh dispatch of ``x`` under a pseudo top-k built from the mask: one slot per rank, naming that rank's
   first expert where the mask is set and -1 elsewhere. Its route is exactly the mask (a token goes once to each
   rank that holds one of its experts), and its handle is the result's handle. The pseudo ids and the per-expert
   counts that dispatch returns describe the pseudo top-k and are dropped.
2. only when ids or weights travel: a cached dispatch on that handle of the ids and weights, packed as raw bytes
   into 16-byte rows typed bf16 (every backend copies rows as bytes), unpacked at the receiver into local expert
   ids (-1 for other ranks' experts) and weights zeroed where the id is not local, as a top-k dispatch gives them.

The rows received, their order (source rank, then source token) and the handle are those of a top-k dispatch
with the same route, so combine and cached re-dispatch work unchanged.

Tokens per local expert: with ``num_tokens_per_expert`` (every rank's int32 ``[E]`` counts), the sum over source
ranks of their entries for this rank's experts, each rounded up to ``expert_alignment`` (DeepEP's definition,
one small all-gather); else counted from the received ids (as a top-k dispatch does); else ``None``.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
import torch.distributed as dist

from . import layout
from . import validation as v

PSEUDO_SLOTS_MAX = v.MAX_TOPK  # slots of the pseudo top-k the kernels take (one lane each)
ROW_BYTES = 16                 # packed id/weight rows are padded to whole 16-byte vectors


def pseudo_topk(is_token_in_rank: torch.Tensor, experts_per_rank: int) -> torch.Tensor:
    """int64 ``[T, K]``: slot ``j`` names the first expert of the ``j``-th rank the token goes to, -1 past them.
    ``K`` is the number of ranks while that fits the kernels' slots; beyond, the ranks a token goes to are packed
    into the first slots (one host read checks that no token goes to more ranks than there are slots)."""
    num_tokens, world = is_token_in_rank.shape
    ranks = torch.arange(world, device=is_token_in_rank.device)
    if world <= PSEUDO_SLOTS_MAX:
        return torch.where(is_token_in_rank, ranks * experts_per_rank, torch.full_like(ranks, -1)).contiguous()
    most = int(is_token_in_rank.sum(dim=1).max()) if num_tokens else 0
    if most > PSEUDO_SLOTS_MAX:
        v.fail("is_token_in_rank", f"a token goes to {most} ranks; route-only dispatch takes at most "
                                   f"{PSEUDO_SLOTS_MAX} ranks per token")
    # selected ranks first (stable: ascending), then the others
    order = torch.argsort((~is_token_in_rank).to(torch.int8), dim=1, stable=True)[:, :PSEUDO_SLOTS_MAX]
    chosen = is_token_in_rank.gather(1, order)
    return torch.where(chosen, order * experts_per_rank, torch.full_like(order, -1)).contiguous()


def pack_rows(topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
              num_tokens: int) -> torch.Tensor:
    """ids (int64) then weights (fp32) of each token as bytes, padded to 16-byte rows, typed bf16 ``[T, B/2]``."""
    parts = [t.contiguous().view(torch.uint8).reshape(num_tokens, t.shape[1] * t.element_size())
             for t in (topk_idx, topk_weights) if t is not None]
    row = torch.cat(parts, dim=1)
    pad = -row.shape[1] % ROW_BYTES
    if pad:
        row = torch.cat([row, row.new_zeros(num_tokens, pad)], dim=1)
    return row.contiguous().view(torch.bfloat16)


def unpack_rows(packed: torch.Tensor, num_idx: int, num_weights: int):
    """The inverse of ``pack_rows`` for received rows: ``(ids int64 [N, num_idx] or None, weights fp32 or None)``."""
    raw = packed.contiguous().view(torch.uint8)
    ids = raw[:, :num_idx * 8].contiguous().view(torch.int64) if num_idx else None
    start = num_idx * 8
    weights = raw[:, start:start + num_weights * 4].contiguous().view(torch.float32) if num_weights else None
    return ids, weights


def received_expert_counts(group, num_tokens_per_expert: torch.Tensor, rank: int, world: int,
                           alignment: int) -> List[int]:
    """DeepEP's tokens per local expert: every rank's counts for this rank's experts, summed, aligned."""
    counts = num_tokens_per_expert.to(torch.int32).contiguous()
    gathered = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(gathered, counts, group=group)
    per_rank = counts.numel() // world
    mine = torch.stack(gathered)[:, rank * per_rank:(rank + 1) * per_rank].sum(dim=0)
    return [(c + alignment - 1) // alignment * alignment for c in mine.tolist()]


def check_inputs(buffer, num_tokens: int, is_token_in_rank, topk_idx, topk_weights, num_experts,
                 num_tokens_per_expert, num_worst_tokens: int) -> int:
    """Validates a route-only dispatch's own arguments; returns the number of experts it works with."""
    world, device = buffer.world_size, buffer.device
    v.check_tensor("is_token_in_rank", is_token_in_rank, (torch.bool,), device, 2, (num_tokens, world))
    if num_worst_tokens:
        v.fail("num_worst_tokens", "a route-only dispatch (is_token_in_rank without a handle) needs "
                                   "num_worst_tokens=0")
    if num_experts is None and num_tokens_per_expert is not None and isinstance(num_tokens_per_expert,
                                                                                   torch.Tensor):
        num_experts = num_tokens_per_expert.numel()
    if num_experts is None:
        if topk_idx is not None:
            v.fail("num_experts", "required with topk_idx")
        num_experts = world  # no experts named: one per rank
    v.check_num_experts(num_experts, world)
    if num_tokens_per_expert is not None:
        v.check_tensor("num_tokens_per_expert", num_tokens_per_expert, (torch.int32, torch.int64), device, 1,
                       (num_experts,))
    if topk_idx is not None:
        v.check_topk_idx(topk_idx, num_tokens, num_experts, device)  # the ids skip the device-side id checks
    if topk_weights is not None:
        k = topk_idx.shape[1] if topk_idx is not None else None
        v.check_topk_weights(topk_weights, (num_tokens, k), device)
    return num_experts


def dispatch(buffer, backend, x, is_token_in_rank: torch.Tensor, topk_idx: Optional[torch.Tensor],
             topk_weights: Optional[torch.Tensor], num_experts: int,
             num_tokens_per_expert: Optional[torch.Tensor], expert_alignment: int, previous_event, async_finish,
             agreed: Optional[dict] = None):
    """``(recv_x, recv_topk_idx or None, recv_topk_weights or None, num_recv_tokens_per_expert or None, handle)``.
    Inputs validated (``check_inputs``); ``buffer`` is the calling ``deepcomm.Buffer``; ``agreed``: the keyword
    arguments of the call's fingerprint (Buffer._agree), for the first of its backend calls."""
    rank, world = buffer.rank, buffer.world_size
    experts_per_rank = num_experts // world
    stream = dict(previous_event=previous_event, async_finish=async_finish)
    pseudo = pseudo_topk(is_token_in_rank, experts_per_rank)
    recv_x, _, _, _, handle = backend.dispatch(x, pseudo, None, num_experts, None, 1, **stream, **(agreed or {}))

    recv_idx = recv_w = None
    if topk_idx is not None or topk_weights is not None:
        num_tokens = is_token_in_rank.shape[0]
        packed = pack_rows(topk_idx, topk_weights, num_tokens)
        got = backend.dispatch(packed, None, None, num_experts, handle, 1, **stream)[0]
        if async_finish and buffer.device.type == "cuda" and backend.event is not None:
            torch.cuda.current_stream(buffer.device).wait_event(backend.event)  # the unpacking reads the rows
        k_idx = topk_idx.shape[1] if topk_idx is not None else 0
        k_w = topk_weights.shape[1] if topk_weights is not None else 0
        global_idx, recv_w = unpack_rows(got, k_idx, k_w)
        if global_idx is not None:
            recv_idx = layout.to_local_experts(global_idx, rank, experts_per_rank)
            if recv_w is not None:
                recv_w = torch.where(recv_idx >= 0, recv_w, torch.zeros_like(recv_w))

    if num_tokens_per_expert is not None:
        counts = received_expert_counts(buffer.group, num_tokens_per_expert, rank, world, expert_alignment)
    elif recv_idx is not None:
        counts = layout.count_rows_per_local_expert(recv_idx, experts_per_rank, expert_alignment)
    else:
        counts = None
    handle = dataclasses.replace(handle, num_recv_tokens_per_expert=list(counts) if counts is not None else [])
    return recv_x, recv_idx, recv_w, counts, handle
