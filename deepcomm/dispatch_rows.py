"""A dispatch's rows as bytes and back, and the dispatch result built from the rows received: shared by the
backends that move rows with torch collectives or torch routing (the reference backend, deepcomm/reference, and
the internode routing, deepcomm/internode/hier_normal.py and hier_kernels.py). Rows travel as uint8 rows, the parts
side by side (x, or the FP8 values and scales, then top-k ids, source index and weights as a call has them)."""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Sequence

import torch

from . import layout
from .handle import Handle


def part_row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row of ``t`` (everything after its first dimension)."""
    return math.prod(t.shape[1:]) * t.element_size()


def as_byte_rows(t: torch.Tensor, rows: int, nbytes: int) -> torch.Tensor:
    """``t`` as uint8 ``[rows, nbytes]``."""
    if t.shape[0] != rows:
        raise RuntimeError(f"exchange_rows: part has {t.shape[0]} rows, expected {rows}")
    return t.contiguous().reshape(-1).view(torch.uint8).reshape(rows, nbytes)


def unpack_rows(out: torch.Tensor, parts: Sequence[torch.Tensor], row_bytes: Sequence[int]) -> List[torch.Tensor]:
    """Split uint8 rows ``out`` (the parts side by side, in order, from byte 0) back into one tensor per part, with
    each part's dtype and trailing shape."""
    tensors, offset = [], 0
    for part, nbytes in zip(parts, row_bytes):
        # flatten before the dtype view: a 1-row slice counts as contiguous but keeps the wide stride
        chunk = out[:, offset:offset + nbytes].contiguous().reshape(-1)
        if chunk.storage_offset() % part.element_size():  # that 1-row view may start mid-element: copy
            chunk = chunk.clone()
        tensors.append(chunk.view(part.dtype).reshape(out.shape[0], *part.shape[1:]))
        offset += nbytes
    return tensors


def dispatch_outputs(received: List[torch.Tensor], num_x_parts: int, is_pair: bool, has_weights: bool,
                     handle: Optional[Handle], rank: int, world: int, num_experts: int, num_tokens: int, hidden: int,
                     is_token_in_rank: torch.Tensor, send_pos: torch.Tensor, count_matrix: torch.Tensor,
                     expert_alignment: int, per_expert: Optional[List[int]] = None, ids_local: bool = False):
    """The dispatch result from the received rows (ordered by source rank, then token), one tensor per part as
    sent: x (or its FP8 values and scales), then, without a handle, the global top-k ids and the source token
    index, then the weights if any. ``per_expert``: the rows per local expert, aligned, when the caller already
    knows them (from the counts it exchanged); else they are counted from the received ids (a host sync).
    ``ids_local``: the ids are local already and the weights of the other slots zero (the internode kernels split
    them so: csrc/runtime/hier_rows.hpp dispatch_unpack_slot)."""
    recv_x = tuple(received[:num_x_parts]) if is_pair else received[0]
    recv_topk_weights = received[-1] if has_weights else None
    if handle is not None:
        # No topk_idx on this path: the weights arrive as sent, non-local slots included.
        return recv_x, None, recv_topk_weights, list(handle.num_recv_tokens_per_expert), handle

    recv_global_idx, recv_src_idx = received[num_x_parts], received[num_x_parts + 1]
    experts_per_rank = num_experts // world
    recv_topk_idx = recv_global_idx if ids_local else layout.to_local_experts(recv_global_idx, rank, experts_per_rank)
    if recv_topk_weights is not None and not ids_local:
        recv_topk_weights = torch.where(recv_topk_idx >= 0, recv_topk_weights,
                                        torch.zeros_like(recv_topk_weights))
    if per_expert is None:
        per_expert = layout.count_rows_per_local_expert(recv_topk_idx, experts_per_rank, expert_alignment)
    new_handle = Handle(buffer_id=-1, num_experts=num_experts, num_tokens=num_tokens, hidden=hidden,
                        num_recv=recv_src_idx.shape[0], is_token_in_rank=is_token_in_rank, send_pos=send_pos,
                        count_matrix=count_matrix, recv_src_idx=recv_src_idx,
                        num_recv_tokens_per_expert=per_expert)
    return recv_x, recv_topk_idx, recv_topk_weights, per_expert, new_handle


def pad_to_worst(out, num_worst_tokens: int, cached: bool):
    """A dispatch result in the worst-case-size form (``num_worst_tokens``): every per-row output has that many
    rows (the real ones first), tokens per expert is an int32 tensor, and a new handle's ``num_recv`` is the
    padded size, so combine takes the padded expert outputs as they are."""
    recv_x, recv_topk_idx, recv_topk_weights, per_expert, handle = out
    n = (recv_x[0] if isinstance(recv_x, tuple) else recv_x).shape[0]
    if n > num_worst_tokens:
        raise ValueError(f"num_worst_tokens: this rank receives {n} rows, more than num_worst_tokens="
                         f"{num_worst_tokens}")

    def pad(t: Optional[torch.Tensor], value) -> Optional[torch.Tensor]:
        if t is None:
            return None
        if t.dtype == torch.float8_e4m3fn:  # pad through bytes: fills of fp8 are not supported everywhere
            return pad(t.view(torch.uint8), value).view(t.dtype)
        return torch.cat([t, t.new_full((num_worst_tokens - n, *t.shape[1:]), value)])

    recv_x = tuple(pad(t, 0) for t in recv_x) if isinstance(recv_x, tuple) else pad(recv_x, 0)
    per_expert_t = torch.tensor([int(c) for c in per_expert], dtype=torch.int32)
    if handle.count_matrix.device.type == "cuda":  # through pinned memory: a pageable copy would sync the stream
        per_expert_t = per_expert_t.pin_memory().to(handle.count_matrix.device, non_blocking=True)
    else:
        per_expert_t = per_expert_t.to(handle.count_matrix.device)
    if not cached:
        handle = dataclasses.replace(handle, num_recv=num_worst_tokens, recv_src_idx=pad(handle.recv_src_idx, -1),
                                     num_recv_tokens_per_expert=per_expert_t)
    return recv_x, pad(recv_topk_idx, -1), pad(recv_topk_weights, 0), per_expert_t, handle
