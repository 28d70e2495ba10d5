"""Low-latency dispatch and combine on torch.distributed (see docs/api.md for the contract).

Entries are (token, slot) pairs whose slot names an expert. This rank sends its entries sorted by global
expert id (stable, so within one expert by token, then slot); that is owner rank ascending, then local
expert, then token, then slot. Combine sends the rows back in that same order.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from .. import agreement, layout
from ..fp8 import BLOCK, per_token_cast_back, per_token_cast_to_fp8
from ..handle import LowLatencyHandle
from .collectives import Comm


def _noop() -> None:
    return None


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    done = []

    def hook() -> None:
        if not done:
            fn()
            done.append(True)
    return hook


def _entries_by_expert(topk_idx: torch.Tensor, num_experts: int, per_expert: torch.Tensor) -> torch.Tensor:
    """Flat (t*K + k) indices of the valid slots, sorted by expert id; ties keep token-then-slot order."""
    flat = topk_idx.reshape(-1)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_experts))
    order = torch.argsort(key, stable=True)
    return order[:int(per_expert.sum())]


def dispatch(comm: Comm, x: torch.Tensor, topk_idx: torch.Tensor, max_tokens: int, num_experts: int,
             use_fp8: bool, use_ue8m0: bool, return_recv_hook: bool,
             fingerprint: Optional[agreement.Fingerprint] = None):
    """Returns ``(recv_x, recv_count, handle, hook)``. ``fingerprint``: compared across ranks in a words-only
    exchange first (the counts exchange below has num_experts entries, a size the ranks must agree on first)."""
    comm.agree(fingerprint, "low_latency_dispatch:agree")
    rank, world, device = comm.rank, comm.world_size, comm.device
    num_tokens, hidden = x.shape
    num_slots = topk_idx.shape[1]
    experts_per_rank = num_experts // world
    rows_per_expert = world * max_tokens

    per_expert = layout.tokens_per_expert(topk_idx, num_experts)               # [E] entries this rank sends
    order = _entries_by_expert(topk_idx, num_experts, per_expert)
    experts = topk_idx.reshape(-1)[order]
    tokens = order // max(num_slots, 1)
    all_counts = comm.all_gather(per_expert, "low_latency_dispatch:counts")    # [R, E]

    # Row of each entry at its expert: entries of lower ranks first, then ours in send order.
    begin_at_owner = all_counts[:rank].sum(dim=0)
    first_entry = torch.cumsum(per_expert, dim=0) - per_expert
    pos = begin_at_owner[experts] + torch.arange(order.numel(), device=device) - first_entry[experts]
    recv_pos = torch.full((num_tokens * num_slots,), -1, dtype=torch.int32, device=device)
    recv_pos[order] = pos.to(torch.int32)
    recv_pos = recv_pos.reshape(num_tokens, num_slots)

    if use_fp8:
        values, scales = per_token_cast_to_fp8(x, use_ue8m0)
        payload = [values.index_select(0, tokens), scales.index_select(0, tokens)]
        recv_x = (torch.zeros(experts_per_rank, rows_per_expert, hidden, dtype=torch.float8_e4m3fn, device=device),
                  torch.zeros(experts_per_rank, rows_per_expert, hidden // BLOCK, dtype=torch.float32,
                              device=device))
    else:
        payload = [x.index_select(0, tokens)]
        recv_x = torch.zeros(experts_per_rank, rows_per_expert, hidden, dtype=x.dtype, device=device)
    parts = payload + [tokens.to(torch.int32), (experts % experts_per_rank).to(torch.int32), pos.to(torch.int32)]

    send_counts = per_expert.reshape(world, experts_per_rank).sum(dim=1).tolist()
    mine = all_counts[:, rank * experts_per_rank:(rank + 1) * experts_per_rank].t()   # [L, R]
    recv_counts = mine.sum(dim=0).tolist()
    pending = comm.exchange_rows(parts, send_counts, recv_counts, "low_latency_dispatch:payload")

    src_info = torch.full((experts_per_rank, rows_per_expert), -1, dtype=torch.int32, device=device)
    begins = torch.cumsum(mine, dim=1) - mine
    handle = LowLatencyHandle(src_info=src_info, layout=torch.stack([begins, mine], dim=-1).to(torch.int32),
                              recv_pos=recv_pos, num_experts=num_experts,
                              num_max_dispatch_tokens_per_rank=max_tokens, hidden=hidden, buffer_id=-1)
    recv_count = mine.sum(dim=1).to(torch.int32)

    def receive() -> None:
        *rows, src_tokens, local_expert, row_pos = pending.wait()
        e, p = local_expert.long(), row_pos.long()
        outputs = recv_x if use_fp8 else (recv_x,)
        for out, got in zip(outputs, rows):
            # byte views: index_put is not implemented for every dtype (fp8) on every device
            out.view(torch.uint8)[e, p] = got.view(torch.uint8)
        src_info[e, p] = src_tokens

    if return_recv_hook:
        return recv_x, recv_count, handle, _once(receive)
    receive()
    return recv_x, recv_count, handle, _noop


def combine(comm: Comm, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            handle: LowLatencyHandle, return_recv_hook: bool, use_fp8: bool = False,
            fingerprint: Optional[agreement.Fingerprint] = None):
    """Returns ``(combined_x, hook)``; ``combined_x`` is bf16 ``[T, H]``.

    Each rank holding experts of a token sums its weighted rows in fp32 (slots ascending) into one partial; the
    partials are added in fp32 over the ranks ascending and rounded once to bf16. A partial from another rank
    crosses the link as bf16 (rounded once); with ``use_fp8`` it travels instead as ``per_token_cast_to_fp8``
    values and scales and is dequantized (``per_token_cast_back``). Our own partial is used as is (fp32).
    ``fingerprint``: compared across ranks in a words-only exchange before any row moves."""
    comm.agree(fingerprint, "low_latency_combine:agree")
    world, device = comm.world_size, comm.device
    num_local, rows_per_expert, hidden = x.shape
    num_tokens, num_slots = topk_idx.shape
    num_experts = handle.num_experts

    # Send back, to each source rank, its entries of each local expert in turn.
    spans: List[List[List[int]]] = handle.layout.tolist()   # [L][R] -> (begin, count)
    index, send_counts = [], []
    for src in range(world):
        sent = 0
        for e in range(num_local):
            begin, count = spans[e][src]
            index.append(torch.arange(begin, begin + count, device=device) + e * rows_per_expert)
            sent += count
        send_counts.append(sent)
    gather = torch.cat(index) if index else torch.zeros(0, dtype=torch.int64, device=device)
    rows_out = x.reshape(num_local * rows_per_expert, hidden).index_select(0, gather)

    per_expert = layout.tokens_per_expert(topk_idx, num_experts)
    order = _entries_by_expert(topk_idx, num_experts, per_expert)
    owner = topk_idx.reshape(-1)[order] // (num_experts // world)
    recv_counts = per_expert.reshape(world, -1).sum(dim=1).tolist()
    pending = comm.exchange_rows([rows_out], send_counts, recv_counts, "low_latency_combine:payload")
    combined_x = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=device)

    def receive() -> None:
        rows = pending.wait()[0]
        tokens, slots = order // max(num_slots, 1), order % max(num_slots, 1)
        # w * x rounded to fp32 on its own (no fused multiply-add), then the two ordered fp32 sums.
        products = rows.float() * topk_weights.reshape(-1)[order].unsqueeze(1)
        acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=device)
        for dst in range(world):
            partial = torch.zeros_like(acc)
            for k in range(num_slots):
                sel = ((owner == dst) & (slots == k)).nonzero()[:, 0]
                partial.index_add_(0, tokens[sel], products[sel])
            if dst != comm.rank:  # what crossed the link
                partial = (per_token_cast_back(*per_token_cast_to_fp8(partial)) if use_fp8
                           else partial.to(torch.bfloat16).float())
            acc += partial
        combined_x.copy_(acc.to(torch.bfloat16))

    if return_recv_hook:
        return combined_x, _once(receive)
    receive()
    return combined_x, _noop
