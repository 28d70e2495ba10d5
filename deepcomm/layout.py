"""Reference layout math: which tokens go to which rank, and where. Pure torch, CPU or CUDA, no host sync."""
from __future__ import annotations

from typing import List, Tuple

import torch


def token_owner_ranks(topk_idx: torch.Tensor, num_experts: int, world_size: int) -> torch.Tensor:
    """Owning rank of each slot, int64 ``[T, K]``; ``world_size`` for ``-1`` slots (a spare column)."""
    experts_per_rank = num_experts // world_size
    return torch.where(topk_idx >= 0, topk_idx // experts_per_rank, torch.full_like(topk_idx, world_size))


def token_in_rank(topk_idx: torch.Tensor, num_experts: int, world_size: int) -> torch.Tensor:
    """bool ``[T, R]``: token ``t`` has at least one expert on rank ``r``."""
    owner = token_owner_ranks(topk_idx, num_experts, world_size)
    mask = torch.zeros(topk_idx.shape[0], world_size + 1, dtype=torch.bool, device=topk_idx.device)
    mask.scatter_(1, owner, True)
    return mask[:, :world_size].contiguous()


def tokens_per_expert(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 ``[E]``: tokens naming each expert, once per token even when several slots name it
    (``-1`` slots land in a dropped spare bin)."""
    bins = torch.where(topk_idx >= 0, topk_idx, torch.full_like(topk_idx, num_experts))
    named = torch.zeros(topk_idx.shape[0], num_experts + 1, dtype=torch.bool, device=topk_idx.device)
    named.scatter_(1, bins, True)
    return named[:, :num_experts].sum(dim=0)


def get_dispatch_layout(topk_idx: torch.Tensor, num_experts: int,
                        world_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R])``.

    A token counts once per rank even when several of its experts live there; ``-1`` slots count nowhere.
    """
    is_token_in_rank = token_in_rank(topk_idx, num_experts, world_size)
    per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
    per_expert = tokens_per_expert(topk_idx, num_experts).to(torch.int32)
    return per_rank, per_expert, is_token_in_rank


def send_positions(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """int32 ``[T, R]``: index of token ``t`` among the tokens sent to rank ``r`` (``-1`` if not sent)."""
    pos = torch.cumsum(is_token_in_rank, dim=0, dtype=torch.int32) - 1
    return torch.where(is_token_in_rank, pos, -1)


def route_and_expert_counts(topk_idx: torch.Tensor, num_experts: int,
                            world_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(token_in_rank(...), tokens_per_expert(...) as int32)`` from one scatter of the ids (half the torch calls
    of the two apart: a backend's per-call path; the reference keeps the two definitions above)."""
    T = topk_idx.shape[0]
    named = torch.zeros(T, num_experts + 1, dtype=torch.bool, device=topk_idx.device)
    named.scatter_(1, torch.where(topk_idx >= 0, topk_idx, num_experts), True)
    named = named[:, :num_experts]
    in_rank = named.view(T, world_size, num_experts // world_size).any(dim=2)
    return in_rank, named.sum(dim=0, dtype=torch.int32)


def send_order(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """int64 token indices in send order: grouped by destination rank ascending, then token index ascending."""
    return is_token_in_rank.t().nonzero()[:, 1]


def to_local_experts(topk_idx: torch.Tensor, rank: int, experts_per_rank: int) -> torch.Tensor:
    """Global expert ids -> local ids of ``rank`` (``e - rank*L``), ``-1`` where the expert lives elsewhere."""
    local = topk_idx - rank * experts_per_rank
    is_local = (local >= 0) & (local < experts_per_rank) & (topk_idx >= 0)
    return torch.where(is_local, local, torch.full_like(local, -1))


def count_rows_per_local_expert(local_idx: torch.Tensor, experts_per_rank: int, alignment: int) -> List[int]:
    """Rows naming each local expert (a row counts once per expert), each rounded up to ``alignment``."""
    bins = torch.where(local_idx >= 0, local_idx, torch.full_like(local_idx, experts_per_rank))
    named = torch.zeros(local_idx.shape[0], experts_per_rank + 1, dtype=torch.bool, device=local_idx.device)
    named.scatter_(1, bins, True)
    counts = named[:, :experts_per_rank].sum(dim=0).tolist()
    return [(c + alignment - 1) // alignment * alignment for c in counts]
