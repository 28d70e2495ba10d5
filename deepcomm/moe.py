"""A ready-to-use expert-parallel MoE layer, and Megatron-shaped fused dispatch/combine helpers.

Everything here is built on the differentiable ``deepcomm.ops.dispatch`` / ``deepcomm.ops.combine``, so it runs
on any backend (the CUDA kernels on GPUs, the reference backend on CPU) and trains with autograd.

Data flow of ``MoELayer.forward(x)`` on one rank (``T`` tokens, hidden ``H``, ``E`` experts, ``L = E / R`` local):

1. router: ``probs = softmax(x @ router.T)`` in fp32, ``topk`` of it (renormalised to sum 1 by default).
2. ``fused_dispatch``: every token goes once to each rank that holds one of its experts; the received rows
   are then *permuted*: one row per (received row, local expert it names), grouped by local expert, ascending
   received-row order inside a group (rows are ordered by source rank then token, so this is deterministic).
3. experts: a grouped SiLU-gated MLP over the permuted rows (one matmul pair per local expert), each output row
   scaled by its routing weight.
4. ``fused_combine``: the rows of one received row are summed (its local experts), then deepcomm's combine sends
   them home and sums the copies: ``y[t] = sum_k w[t, k] * expert_{idx[t, k]}(x[t])``.

Gradients reach ``x`` (through the data path and the router), the router weight and the expert weights.
The router weight is *replicated* on every rank (each rank computes its own tokens' routing); expert weights
are *sharded* (rank ``r`` holds experts ``[r*L, (r+1)*L)``). When every rank back-propagates its own loss, the
expert gradients already contain every rank's contribution; the router gradient holds only this rank's
tokens: ``MoELayer.sync_replicated_grads()`` sums it over the group (see ``examples/train_moe.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import ops
from .handle import Handle

if TYPE_CHECKING:  # annotations only
    from .buffer import Buffer


# ---- fused dispatch / combine ------------------------------------------------------------------------------
@dataclass
class FusedContext:
    """What ``fused_combine`` needs to undo ``fused_dispatch``'s permutation and route."""

    handle: Handle                 # route of the underlying deepcomm dispatch
    row_index: torch.Tensor        # int64 [M]: received row of each permuted row (num_recv for padding rows)
    num_recv: int                  # N: rows deepcomm's dispatch received
    tokens_per_expert: List[int]   # rows of each local expert's group (aligned as requested)
    dtype: torch.dtype             # dtype of the dispatched x (fused_combine's output dtype)


def _local_expert_weights(recv_topk_idx: torch.Tensor, recv_topk_weights: Optional[torch.Tensor],
                          num_local: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(member bool [N, L], weight fp32 [N, L])``: which local experts each received row names and the summed
    weight of its slots naming each (two slots naming one expert become one row of that expert)."""
    n = recv_topk_idx.shape[0]
    column = torch.where(recv_topk_idx >= 0, recv_topk_idx, torch.full_like(recv_topk_idx, num_local))
    member = torch.zeros(n, num_local + 1, dtype=torch.int32, device=recv_topk_idx.device)
    member.scatter_add_(1, column, torch.ones_like(column, dtype=torch.int32))
    weight = None
    if recv_topk_weights is not None:
        weight = torch.zeros(n, num_local + 1, dtype=recv_topk_weights.dtype, device=recv_topk_weights.device)
        weight = weight.scatter_add(1, column, recv_topk_weights)[:, :num_local]
    return member[:, :num_local] > 0, weight


def fused_dispatch(buffer: "Buffer", x: torch.Tensor, topk_idx: torch.Tensor, probs: Optional[torch.Tensor],
                   num_experts: int, expert_alignment: int = 1
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, "FusedContext"]:
    """Dispatch ``x`` and permute the received rows into per-local-expert groups.

    Arguments (``T`` tokens on this rank, hidden ``H``, top-k ``K``, ``E`` experts, ``L = E / R``):
      x            ``[T, H]`` (bf16 on the CUDA backend; the reference backend also takes fp16/fp32/fp64)
      topk_idx     int64 ``[T, K]``, ``-1`` = no expert
      probs        fp32 ``[T, K]`` routing weights, or ``None``
      expert_alignment  each group is padded with zero rows to a multiple of this (grouped-GEMM tiles)

    Returns ``(permuted_tokens, tokens_per_expert, probs_per_row, ctx)``:
      permuted_tokens  ``[M, H]``, ``x.dtype``: one row per (received token, local expert it names), grouped by
                       local expert; group ``l`` is rows ``[sum(tokens_per_expert[:l]), sum(tokens_per_expert[:l+1]))``;
                       padding rows (alignment) are zero
      tokens_per_expert  int64 ``[L]`` on the CPU (what grouped GEMMs take), ``M = tokens_per_expert.sum()``
      probs_per_row    fp32 ``[M]``: the routing weight of each row's (token, expert) pair (0 for padding rows),
                       or ``None`` when ``probs`` is ``None``
      ctx              a ``FusedContext`` for ``fused_combine``

    Differentiable: gradients flow to ``x`` and ``probs``. Like Megatron's fused dispatch, the weights are *not*
    applied here: scale the expert outputs by ``probs_per_row`` before ``fused_combine``.
    """
    recv_x, recv_idx, recv_w, counts, handle = ops.dispatch(buffer, x, topk_idx, probs, num_experts,
                                                            expert_alignment=expert_alignment)
    num_local = num_experts // buffer.world_size
    n, dev = recv_x.shape[0], recv_x.device
    member, weight = _local_expert_weights(recv_idx, recv_w, num_local)
    if not torch.compiler.is_compiling():  # a check of the backend's counts (data-dependent: eager only)
        raw = member.sum(dim=0)
        aligned = (raw + expert_alignment - 1) // expert_alignment * expert_alignment
        if aligned.tolist() != list(counts):
            raise RuntimeError(f"deepcomm.moe: per-expert rows {raw.tolist()} disagree with dispatch's counts "
                               f"{counts}")
    # Permuted row of each (received row, local expert it names): its expert's group start (groups padded to the
    # alignment) plus its rank among the group's rows (rows ascending). Pairs that do not exist go to a spare
    # position past the end, dropped. No data-dependent shapes beyond the counts, so torch.compile traces it.
    total = sum(counts)
    # the counts as a tensor: inside a compiled graph the dispatch operator's own (not rebuilt from symbolic ints)
    per_expert = handle.per_expert_tensor
    per_expert = torch.tensor(counts, dtype=torch.int64) if per_expert is None else per_expert.to(torch.int64)
    starts = (per_expert.cumsum(0) - per_expert).to(dev)
    place = starts + member.to(torch.int64).cumsum(dim=0) - 1                       # [N, L]
    dest = torch.where(member, place, torch.full_like(place, total)).reshape(-1)
    rows = torch.arange(n, device=dev).unsqueeze(1).expand(n, num_local)
    experts = torch.arange(num_local, device=dev).unsqueeze(0).expand(n, num_local)
    row_index = torch.full((total + 1,), n, dtype=torch.int64, device=dev)
    row_index = row_index.scatter(0, dest, torch.where(member, rows, n).reshape(-1))[:total]
    padded_x = torch.cat([recv_x, recv_x.new_zeros(1, recv_x.shape[1])])
    permuted = padded_x.index_select(0, row_index)
    probs_per_row = None
    if weight is not None:
        padded_w = torch.cat([weight, weight.new_zeros(1, num_local)])
        column = torch.zeros(total + 1, dtype=torch.int64, device=dev)
        column = column.scatter(0, dest, torch.where(member, experts, 0).reshape(-1))[:total]
        probs_per_row = padded_w[row_index, column]
    ctx = FusedContext(handle=handle, row_index=row_index, num_recv=n, tokens_per_expert=list(counts),
                       dtype=x.dtype)
    return permuted, per_expert, probs_per_row, ctx


def fused_combine(buffer: "Buffer", expert_out: torch.Tensor, ctx: FusedContext) -> torch.Tensor:
    """Undo ``fused_dispatch``: sum each received token's rows (its local experts; accumulated in fp32, fp64 for
    fp64), then combine them back to their source ranks. ``expert_out`` is ``[M, H]`` in permuted order (scale it by
    ``probs_per_row`` first); returns ``[T, H]`` in the dtype ``x`` had at dispatch. Differentiable."""
    if expert_out.dim() != 2 or expert_out.shape[0] != ctx.row_index.shape[0]:
        raise ValueError(f"expert_out: expected [{ctx.row_index.shape[0]}, H], got {tuple(expert_out.shape)}")
    acc = torch.float64 if expert_out.dtype == torch.float64 else torch.float32
    rows = expert_out.new_zeros(ctx.num_recv + 1, expert_out.shape[1], dtype=acc)
    rows = rows.index_add(0, ctx.row_index, expert_out.to(acc))[:ctx.num_recv].to(ctx.dtype)
    out, _ = ops.combine(buffer, rows.contiguous(), ctx.handle)
    return out


# ---- experts -----------------------------------------------------------------------------------------------
def grouped_swiglu(x: torch.Tensor, tokens_per_expert, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """SiLU-gated MLP per expert over grouped rows: group ``l`` of ``x`` (``tokens_per_expert[l]`` rows) gives
    ``(silu(x_l @ G_l) * (x_l @ U_l)) @ w_down[l]`` with ``[G_l | U_l] = w_gate_up[l]`` (``[H, 2F]``, ``w_down[l]``
    ``[F, H]``). A plain loop of matmuls: replace it with a grouped GEMM for speed."""
    # Python ints, or the symbolic ints of fused_dispatch's counts under torch.compile
    counts = [c if isinstance(c, torch.SymInt) else int(c) for c in tokens_per_expert]
    ffn = w_down.shape[1]
    outs = []
    for l, part in enumerate(torch.split(x, counts)):
        gate_up = part @ w_gate_up[l]
        outs.append((F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]) @ w_down[l])
    if not outs:
        return x.new_zeros(0, w_down.shape[2])
    return torch.cat(outs)


def route(x: torch.Tensor, router_weight: torch.Tensor, topk: int,
          normalize: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(topk_idx int64 [T, K], topk_weights fp32 [T, K])``: softmax over ``x @ router_weight.T`` (computed in fp32,
    fp64 for fp64 input), its ``topk`` largest, renormalised to sum 1 when ``normalize``, then fp32 (the contract's
    weight dtype)."""
    logits = x @ router_weight.t()
    probs = torch.softmax(logits.double() if logits.dtype == torch.float64 else logits.float(), dim=-1)
    weights, idx = probs.topk(topk, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return idx, weights.float()


def _scale(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``rows * weights[:, None]``: in the rows' dtype for fp32/fp64, else in fp32 with one rounding back."""
    if rows.dtype in (torch.float32, torch.float64):
        return rows * weights.to(rows.dtype).unsqueeze(1)
    return (rows.float() * weights.float().unsqueeze(1)).to(rows.dtype)


def dense_moe(x: torch.Tensor, router_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              topk: int, normalize: bool = True) -> torch.Tensor:
    """The same layer on one process with *all* ``E`` experts (``w_gate_up [E, H, 2F]``, ``w_down [E, F, H]``):
    ``y[t] = sum_k w[t, k] * expert_{idx[t, k]}(x[t])``. For tests and as a teacher model."""
    idx, weights = route(x, router_weight, topk, normalize)
    ffn = w_down.shape[1]
    y = torch.zeros_like(x)
    for k in range(topk):
        gate_up = torch.bmm(x.unsqueeze(1), w_gate_up[idx[:, k]]).squeeze(1)
        out = torch.bmm((F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]).unsqueeze(1), w_down[idx[:, k]]).squeeze(1)
        y = y + _scale(out, weights[:, k])
    return y


# ---- the layer ---------------------------------------------------------------------------------------------
class MoELayer(torch.nn.Module):
    """Expert-parallel MoE layer: router, ``num_experts / R`` local SiLU-gated experts, deepcomm dispatch/combine.

    ``MoELayer(buffer, hidden, ffn_hidden, num_experts, topk, normalize_topk=True, expert_alignment=1,
    dtype=None, device=None)``; ``forward(x [T, H]) -> [T, H]``. Parameters: ``router.weight`` ``[E, H]``
    (replicated), ``w_gate_up`` ``[L, H, 2F]`` and ``w_down`` ``[L, F, H]`` (this rank's experts
    ``first_expert .. first_expert + L - 1``). ``dtype`` defaults to bf16 on the CUDA backend, fp32 otherwise.
    After ``forward``, ``last_tokens_per_expert`` holds the rows each local expert received.
    """

    def __init__(self, buffer, hidden: int, ffn_hidden: int, num_experts: int, topk: int, normalize_topk: bool = True,
                 expert_alignment: int = 1, dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        world = buffer.world_size
        if num_experts % world != 0:
            raise ValueError(f"num_experts: {num_experts} is not a multiple of the group size {world}")
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk: expected 1..{num_experts}, got {topk}")
        if hidden > buffer.config.hidden:
            raise ValueError(f"hidden: {hidden} is over the Buffer's hidden {buffer.config.hidden}")
        self.buffer = buffer
        self.hidden, self.ffn_hidden, self.num_experts, self.topk = hidden, ffn_hidden, num_experts, topk
        self.normalize_topk, self.expert_alignment = normalize_topk, expert_alignment
        self.num_local_experts = num_experts // world
        self.first_expert = buffer.rank * self.num_local_experts
        if dtype is None:
            dtype = torch.bfloat16 if buffer.backend_name == "cuda" else torch.float32
        device = buffer.device if device is None else device
        self.router = torch.nn.Linear(hidden, num_experts, bias=False, dtype=dtype, device=device)
        L = self.num_local_experts
        self.w_gate_up = torch.nn.Parameter(torch.empty(L, hidden, 2 * ffn_hidden, dtype=dtype, device=device))
        self.w_down = torch.nn.Parameter(torch.empty(L, ffn_hidden, hidden, dtype=dtype, device=device))
        with torch.no_grad():
            self.w_gate_up.uniform_(-1 / math.sqrt(hidden), 1 / math.sqrt(hidden))
            self.w_down.uniform_(-1 / math.sqrt(ffn_hidden), 1 / math.sqrt(ffn_hidden))
        self.last_tokens_per_expert: Optional[torch.Tensor] = None

    def expert_parameters(self) -> List[torch.nn.Parameter]:
        """Parameters sharded over the group (each rank owns different experts)."""
        return [self.w_gate_up, self.w_down]

    def replicated_parameters(self) -> List[torch.nn.Parameter]:
        """Parameters every rank holds a copy of (the router)."""
        return [self.router.weight]

    @torch.no_grad()
    def load_global_experts(self, w_gate_up_all: torch.Tensor, w_down_all: torch.Tensor) -> None:
        """Copy this rank's slice of all-expert weights (``[E, H, 2F]``, ``[E, F, H]``) into the layer."""
        sl = slice(self.first_expert, self.first_expert + self.num_local_experts)
        self.w_gate_up.copy_(w_gate_up_all[sl])
        self.w_down.copy_(w_down_all[sl])

    def sync_replicated_grads(self) -> None:
        """Sum the replicated parameters' gradients over the group (use it with a per-rank loss divided by R)."""
        for p in self.replicated_parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.buffer.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x: expected [T, {self.hidden}], got {tuple(x.shape)}")
        topk_idx, topk_weights = route(x, self.router.weight, self.topk, self.normalize_topk)
        permuted, tokens_per_expert, probs_per_row, ctx = fused_dispatch(
            self.buffer, x, topk_idx, topk_weights, self.num_experts, self.expert_alignment)
        self.last_tokens_per_expert = tokens_per_expert
        out = grouped_swiglu(permuted, ctx.tokens_per_expert, self.w_gate_up, self.w_down)
        out = _scale(out, probs_per_row)
        return fused_combine(self.buffer, out, ctx)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, num_experts={self.num_experts}, "
                f"topk={self.topk}, local_experts=[{self.first_expert}, "
                f"{self.first_expert + self.num_local_experts}), backend={self.buffer.backend_name}")


__all__ = ["FusedContext", "MoELayer", "dense_moe", "fused_combine", "fused_dispatch", "grouped_swiglu", "route"]
