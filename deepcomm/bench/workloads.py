"""Seeded random routing and inputs (docs/benchmarks/README.md: topk of |randn| scores).

Every rank runs the same code with the same seed mixed with its rank, so a run is reproducible and
each rank routes different tokens. Nothing here depends on deepcomm: the peers use it too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Workload:
    tokens: int
    hidden: int
    topk: int
    experts: int
    seed: int = 0


@dataclass
class Inputs:
    x: torch.Tensor                  # bf16 [T, H]
    topk_idx: torch.Tensor           # int64 [T, K]
    topk_weights: torch.Tensor       # fp32 [T, K]
    is_token_in_rank: torch.Tensor   # bool [T, R]
    count_matrix: torch.Tensor       # int64 [R, R] (CPU): tokens rank s sends to rank d

    def send_counts(self, rank: int) -> list[int]:
        return self.count_matrix[rank].tolist()

    def recv_counts(self, rank: int) -> list[int]:
        return self.count_matrix[:, rank].tolist()

    def num_recv_rows(self, rank: int) -> int:
        return int(self.count_matrix[:, rank].sum())


def make_generator(seed: int, rank: int, salt: int = 0) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + rank * 7919 + salt) & 0x7FFF_FFFF_FFFF)
    return g


def make_routing(num_tokens: int, num_experts: int, topk: int, gen: torch.Generator):
    """topk of |randn| scores; weights are the softmax of the chosen scores (fp32)."""
    scores = torch.randn(num_tokens, num_experts, generator=gen).abs()
    values, idx = torch.topk(scores, topk, dim=-1, sorted=True)
    weights = torch.softmax(values, dim=-1).float()
    return idx.to(torch.int64), weights


def token_in_rank(topk_idx: torch.Tensor, num_experts: int, world_size: int) -> torch.Tensor:
    """bool [T, R]: token t goes to rank r (once, however many of its experts live there)."""
    local = num_experts // world_size
    valid = topk_idx >= 0
    dst = torch.where(valid, topk_idx // local, torch.full_like(topk_idx, world_size))
    mask = torch.zeros(topk_idx.shape[0], world_size + 1, dtype=torch.bool, device=topk_idx.device)
    mask.scatter_(1, dst, True)
    return mask[:, :world_size]


def make_inputs(wl: Workload, rank: int, world_size: int, device: torch.device, group=None) -> Inputs:
    """Inputs of this rank plus the full [R, R] count matrix (one all_gather, outside any timing)."""
    import torch.distributed as dist

    if wl.experts % world_size:
        raise ValueError(f"experts: {wl.experts} is not a multiple of the world size {world_size}")
    gen = make_generator(wl.seed, rank, salt=wl.tokens)
    topk_idx, topk_weights = make_routing(wl.tokens, wl.experts, wl.topk, gen)
    x = torch.randn(wl.tokens, wl.hidden, generator=gen).to(torch.bfloat16)
    in_rank = token_in_rank(topk_idx, wl.experts, world_size)
    counts = in_rank.sum(0).to(torch.int64).to(device)
    gathered = [torch.empty_like(counts) for _ in range(world_size)]
    dist.all_gather(gathered, counts, group=group)
    count_matrix = torch.stack(gathered).cpu()
    return Inputs(x=x.to(device), topk_idx=topk_idx.to(device), topk_weights=topk_weights.to(device),
                  is_token_in_rank=in_rank.to(device), count_matrix=count_matrix)
