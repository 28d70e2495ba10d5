"""A fresh internode dispatch's route and count-round row, made in one launch with no host sync
(csrc/kernels/hier_route.hpp) into one int32 workspace whose layout the extension gives (``hier_route_work``,
csrc/runtime/hier_route_layout.hpp): send positions, with several GPUs per node the rdma slots, node masks and
the combine's held slots, is_token_in_rank, and the row the count round sends (the call's words, tokens per rank,
per node and per expert, and how many expert ids were outside [-1, E)). ``fill_reference`` makes the same
workspace with torch: the oracle the GPU tests compare the kernel with, and what a CPU device runs (the stand-ins of
the tests)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence, Tuple

import torch

from .. import layout
from .._ext import load_extension
from .hier_normal import node_masks


@dataclasses.dataclass
class RouteTables:
    """Views of one route workspace (``work``, which they keep alive)."""
    in_rank: torch.Tensor               # bool [T, R]
    send_pos: torch.Tensor              # int32 [T, R]
    rdma_slot: torch.Tensor             # int32 [T, N]: send_pos itself with one GPU per node
    masks: Optional[torch.Tensor]       # int32 [T, N], None with one GPU per node
    row: torch.Tensor                   # int32 [width]
    parts: dict                         # the workspace's layout (hier_route_work): the row's offsets among it
                                        # (row_words, row_ranks, ..., row_bad, row_width)


@functools.lru_cache(maxsize=256)
def route_work(tokens: int, ranks: int, gpus: int, num_experts: int, with_words: bool) -> dict:
    """The workspace's offsets (int32 elements), asked of the extension once per shape."""
    return load_extension().hier_route_work(tokens, ranks, gpus, num_experts, with_words)


def route(T_module, topk_idx: torch.Tensor, num_experts: int, ranks: int, gpus: int,
          fingerprint: Optional[Sequence[int]] = None) -> RouteTables:
    """The route of ``topk_idx`` ([T, K] int64) over ``ranks`` ranks of ``gpus`` GPUs per node, queued on the
    current stream (CUDA: the kernel of ``T_module``, deepcomm._C.transport; else fill_reference)."""
    T, K = topk_idx.shape
    lay = route_work(T, ranks, gpus, num_experts, fingerprint is not None)
    work = torch.empty(lay["total"], dtype=torch.int32, device=topk_idx.device)
    if topk_idx.device.type == "cuda":
        T_module.hier_route(topk_idx.data_ptr(), T, K, num_experts, ranks, gpus,
                            None if fingerprint is None else tuple(fingerprint), work.data_ptr(),
                            torch.cuda.current_stream(topk_idx.device).cuda_stream)
    else:
        fill_reference(work, lay, topk_idx, num_experts, ranks, gpus, fingerprint)
    return tables_of(work, lay, T, ranks, gpus)


def tables_of(work: torch.Tensor, lay: dict, T: int, ranks: int, gpus: int) -> RouteTables:
    """The tables' views of a filled workspace (one torch call each: they are made on every fresh dispatch)."""
    R, G = ranks, gpus
    N = R // G
    send_pos = work.as_strided((T, R), (R, 1), lay["send_pos"])
    in_rank = work.view(torch.bool).as_strided((T, R), (R, 1), 4 * lay["in_rank"])
    row = work.as_strided((lay["row_width"],), (1,), lay["row"])
    if G == 1:
        return RouteTables(in_rank, send_pos, send_pos, None, row, lay)
    rdma_slot = work.as_strided((T, N), (N, 1), lay["rdma_slot"])
    masks = work.as_strided((T, N), (N, 1), lay["masks"])
    return RouteTables(in_rank, send_pos, rdma_slot, masks, row, lay)


def held_pointers(t: RouteTables) -> Tuple[int, int]:
    """The device addresses of a route's ``held_slot`` and ``one_held`` (hier_route_layout.hpp), which only the
    combine kernel reads, without a view of them (a fresh dispatch makes its route's views on every call): with one
    GPU per node the send positions and 0. The route's views keep the workspace alive."""
    if t.masks is None:
        return t.send_pos.data_ptr(), 0
    base = t.row.data_ptr() - 4 * t.parts["row"]  # the row is never empty (a view without elements may say 0)
    return base + 4 * t.parts["held_slot"], base + 4 * t.parts["one_held"]


def held_views(t: RouteTables) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(held_slot int32 [T, N], one_held int32 [N])`` of a route as tensors (``(send_pos, None)`` with one GPU per
    node), for checks."""
    if t.masks is None:
        return t.send_pos, None
    T, N = t.rdma_slot.shape
    work = t.send_pos.as_strided((t.parts["total"],), (1,), t.send_pos.storage_offset() - t.parts["send_pos"])
    return (work.as_strided((T, N), (N, 1), work.storage_offset() + t.parts["held_slot"]),
            work.as_strided((N,), (1,), work.storage_offset() + t.parts["one_held"]))


def fill_reference(work: torch.Tensor, lay: dict, topk_idx: torch.Tensor, num_experts: int, ranks: int,
                   gpus: int, fingerprint: Optional[Sequence[int]] = None) -> None:
    """The workspace the kernel writes, made with torch (on ``work``'s device; its padding left as it is)."""
    T = topk_idx.shape[0]
    R, G, E = ranks, gpus, num_experts
    N = R // G
    dev = work.device
    ids = topk_idx.to(dev)
    valid = (ids >= 0) & (ids < E)
    bad = int(((ids < -1) | (ids >= E)).sum())
    named = torch.zeros(T, E + 1, dtype=torch.bool, device=dev)  # a spare column for -1 and bad ids
    named.scatter_(1, torch.where(valid, ids, E), True)
    named = named[:, :E]
    in_rank = named.view(T, R, E // R).any(dim=2)
    send_pos = layout.send_positions(in_rank)
    work[lay["send_pos"]:lay["send_pos"] + T * R] = send_pos.reshape(-1)
    work[lay["in_rank"]:].view(torch.uint8)[:T * R] = in_rank.reshape(-1).to(torch.uint8)
    row = work[lay["row"]:lay["row"] + lay["row_width"]]
    row.zero_()
    if fingerprint is not None:
        row[lay["row_words"]:lay["row_ranks"]] = torch.tensor(list(fingerprint), dtype=torch.int32)
    row[lay["row_ranks"]:lay["row_ranks"] + R] = in_rank.sum(dim=0, dtype=torch.int32)
    if G > 1:
        in_node = in_rank.view(T, N, G).any(dim=2)
        rdma = torch.where(in_node, torch.cumsum(in_node, dim=0, dtype=torch.int32) - 1, -1)
        work[lay["rdma_slot"]:lay["rdma_slot"] + T * N] = rdma.reshape(-1)
        work[lay["masks"]:lay["masks"] + T * N] = node_masks(in_rank, N, G).reshape(-1)
        held, one_held = held_slots(in_rank, rdma, N, G)
        work[lay["held_slot"]:lay["held_slot"] + T * N] = held.reshape(-1)
        work[lay["one_held"]:lay["one_held"] + N] = one_held
        row[lay["row_nodes"]:lay["row_nodes"] + N] = in_node.sum(dim=0, dtype=torch.int32)
    row[lay["row_experts"]:lay["row_experts"] + E] = named.sum(dim=0, dtype=torch.int32)
    row[lay["row_bad"]] = bad


def held_slots(in_rank: torch.Tensor, rdma_slot: torch.Tensor, num_nodes: int, gpus: int):
    """``(held_slot int32 [T, N], one_held int32 [N])`` of the route (runtime/hier_route_layout.hpp), several GPUs per
    node: a token node m holds on one GPU gets its index among those, one it holds on several -(its index among
    those) - 1 (its rdma slot less the single-held tokens before it), one it does not hold -1; ``one_held`` counts
    the single-held tokens of each node. ``rdma_slot``: the route's int32 [T, N]."""
    T, N, G = in_rank.shape[0], num_nodes, gpus
    one = in_rank.view(T, N, G).sum(dim=2) == 1
    ones_before = torch.cumsum(one, dim=0, dtype=torch.int32) - one.to(torch.int32)
    held = torch.where(one, ones_before, torch.where(rdma_slot >= 0, ones_before - rdma_slot - 1, -1))
    return held.to(torch.int32), one.sum(dim=0, dtype=torch.int32)
