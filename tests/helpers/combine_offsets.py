"""Where the internode combine kernel reads each token's partial from each node (csrc/kernels/hier_combine.cu,
sum_tokens), from the dispatch route's tables, in torch: the byte offset in that node's block, >= 0 an fp32
partial, <= -2 a held row at -offset - 2, -1 nothing. The CPU tests hold it against the contract
(hier_kernels.hpp) and against where the dispatch's forwarding put the rows."""
from typing import Optional

import torch


def recv_offsets(rdma_slot: torch.Tensor, held_slot: torch.Tensor, one_held: Optional[torch.Tensor], node: int,
                 held_stride: int, partial_stride: int) -> torch.Tensor:
    """int64 [T, N]. ``rdma_slot`` / ``held_slot`` int32 [T, N] (with one GPU per node both the send positions),
    ``one_held`` int32 [N] (None with one GPU per node: never needed), ``node``: ours."""
    slot, k = rdma_slot.to(torch.int64), held_slot.to(torch.int64)
    ones = one_held.to(torch.int64) if one_held is not None else torch.zeros(slot.shape[1], dtype=torch.int64)
    other = torch.where(k >= 0, -k * held_stride - 2, ones * held_stride + (-k - 1) * partial_stride)
    own = torch.zeros(slot.shape[1], dtype=torch.bool)
    own[node] = True
    return torch.where(slot < 0, -1, torch.where(own, slot * partial_stride, other))
