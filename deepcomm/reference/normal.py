"""Normal-mode dispatch and combine on torch.distributed (see docs/api.md for the contract)."""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch

from .. import agreement, layout
from ..fp8 import per_token_cast_back, per_token_cast_to_fp8
from ..dispatch_rows import dispatch_outputs
from ..handle import Handle
from .collectives import Comm

Payload = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def dispatch(comm: Comm, x: Payload, topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
             num_experts: Optional[int], handle: Optional[Handle], expert_alignment: int,
             fingerprint: Optional[agreement.Fingerprint] = None):
    """Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert, handle)``. ``fingerprint``:
    the call's words (deepcomm/agreement.py), compared across ranks in its first exchange (the counts of a fresh
    dispatch, a words-only exchange of a cached one) before any row moves."""
    rank, world = comm.rank, comm.world_size
    is_pair = isinstance(x, (tuple, list))
    rows = list(x) if is_pair else [x]
    num_tokens, hidden = rows[0].shape

    if handle is None:
        is_token_in_rank = layout.token_in_rank(topk_idx, num_experts, world)
        send_pos = layout.send_positions(is_token_in_rank)
        sent_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
        count_matrix = comm.agree(fingerprint, "dispatch:counts", counts=sent_per_rank)
    else:
        comm.agree(fingerprint, "dispatch:agree")
        is_token_in_rank, send_pos, count_matrix = handle.is_token_in_rank, handle.send_pos, handle.count_matrix
    counts = count_matrix.tolist()
    send_counts = counts[rank]
    recv_counts = [counts[src][rank] for src in range(world)]

    order = layout.send_order(is_token_in_rank)
    parts = [r.index_select(0, order) for r in rows]
    if handle is None:
        parts += [topk_idx.index_select(0, order), order.to(torch.int32)]
    if topk_weights is not None:
        parts.append(topk_weights.index_select(0, order))
    received = comm.exchange_rows(parts, send_counts, recv_counts, "dispatch:payload").wait()

    return dispatch_outputs(received, len(rows), is_pair, topk_weights is not None, handle, rank, world, num_experts,
                            num_tokens, hidden, is_token_in_rank, send_pos, count_matrix, expert_alignment)


def combine(comm: Comm, x: torch.Tensor, handle: Handle, topk_weights: Optional[torch.Tensor],
            use_fp8: bool = False, gpus_per_node: Optional[int] = None,
            fingerprint: Optional[agreement.Fingerprint] = None):
    """Returns ``(combined_x, combined_topk_weights)``: per token, the fp32 sum of its rows, grouped as the
    hierarchical path adds them: within each node over its ranks ascending, then the node partials over nodes
    ascending (docs/internode.md). One node (``gpus_per_node`` None or the world size) or one GPU per node both
    give the flat sum over ranks ascending.

    ``use_fp8``: every row travels as ``per_token_cast_to_fp8`` values and fp32 scales and is dequantized
    (``per_token_cast_back``, one fp32 multiply per element) before the fp32 sum; the rows a rank sends to itself
    never cross a link and are summed from ``x`` unchanged, as the CUDA kernel does.

    ``fingerprint``: compared across ranks in a words-only exchange before any row moves."""
    comm.agree(fingerprint, "combine:agree")
    rank, world = comm.rank, comm.world_size
    counts = handle.count_matrix.tolist()
    # Rows go back to their source ranks (our rows are already grouped by source); we receive, from each
    # destination d in turn, the rows of our tokens sent to d, in token order.
    send_counts = [counts[src][rank] for src in range(world)]
    recv_counts = counts[rank]
    real = sum(send_counts)  # x may be worst-case sized (num_worst_tokens): rows past the real ones are ignored
    rows = list(per_token_cast_to_fp8(x[:real])) if use_fp8 else [x[:real]]
    parts = rows + ([topk_weights[:real]] if topk_weights is not None else [])
    received = comm.exchange_rows(parts, send_counts, recv_counts, "combine:payload").wait()

    if use_fp8:
        got = per_token_cast_back(received[0], received[1])
        # Rows from ourselves arrive in the same order as our own block of x (source = us, token order).
        own_x, own_got = sum(send_counts[:rank]), sum(recv_counts[:rank])
        n_own = counts[rank][rank]
        got[own_got:own_got + n_own] = x[own_x:own_x + n_own].float()
        received = [got] + received[2:]
    gpn = gpus_per_node or world
    combined_x = _reduce(received[0], handle, recv_counts, x.dtype, gpn)
    combined_w = _reduce(received[1], handle, recv_counts, torch.float32, gpn) if topk_weights is not None else None
    return combined_x, combined_w


def _reduce(rows: torch.Tensor, handle: Handle, recv_counts: List[int], out_dtype: torch.dtype,
            gpus_per_node: int) -> torch.Tensor:
    acc_dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    begins = [sum(recv_counts[:d]) for d in range(len(recv_counts))]

    def node_sum(ranks: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """The node's partial sums (ranks ascending, from +0) and which tokens it holds."""
        part = torch.zeros(handle.num_tokens, *rows.shape[1:], dtype=acc_dtype, device=rows.device)
        for dst in ranks:
            if recv_counts[dst]:
                tokens = handle.is_token_in_rank[:, dst].nonzero()[:, 0]
                # each token appears at most once per rank, so this is one exact add per element
                part.index_add_(0, tokens, rows[begins[dst]:begins[dst] + recv_counts[dst]].to(acc_dtype))
        return part, handle.is_token_in_rank[:, ranks].any(dim=1)

    world = len(recv_counts)
    if gpus_per_node >= world:
        return node_sum(list(range(world)))[0].to(out_dtype)
    acc = torch.zeros(handle.num_tokens, *rows.shape[1:], dtype=acc_dtype, device=rows.device)
    for first in range(0, world, gpus_per_node):
        part, held = node_sum(list(range(first, first + gpus_per_node)))
        tokens = held.nonzero()[:, 0]  # a node adds its partial only for the tokens it holds (no +0 added)
        acc.index_add_(0, tokens, part[tokens])
    return acc.to(out_dtype)
