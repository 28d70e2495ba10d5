"""DeepEP's handle tuples, built from deepcomm's handles, and the way back for combine.

The tuples have DeepEP V1's layout and, where deepcomm's route determines them, DeepEP's contents (docs/api.md,
"DeepEP handles"); items describing DeepEP's channel ring buffers that deepcomm's route does not determine are
DeepEP-shaped and filled with -1.

- intranode: ``(rank_prefix_matrix [R, R], channel_prefix_matrix [R, C], recv_channel_prefix_matrix [R, C],
  recv_src_idx [N], is_token_in_rank [T, R], send_head [T, R])``, ``C = config.num_sms // 2`` channels, each a
  contiguous range of ``ceil(T / C)`` tokens as in DeepEP. All but ``recv_channel_prefix_matrix`` (it needs each
  source's token count) are DeepEP's values.
- internode: ``(is_token_in_rank, rdma_channel_prefix_matrix [nodes, C], gbl_channel_prefix_matrix [R, C],
  recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum [nodes], recv_gbl_channel_prefix_matrix,
  recv_gbl_rank_prefix_sum [R], recv_src_meta [N, 8] uint8, send_rdma_head [T, nodes], send_nvl_head [*, 8])``.
- low-latency: ``(src_info int32 [L, R*M], layout_range int64 [L, R], M, hidden, num_experts)``, ``layout_range``
  packing ``begin << 32 | count`` as DeepEP's ``pack2(count, begin)``.

Each tuple is a ``DeepEPHandle`` (a tuple) that carries the deepcomm handle; a tuple rebuilt from the items is
still found through the identity of its key tensor (item 0 intranode, 6 internode, 1 low-latency).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from ...handle import Handle, LowLatencyHandle
from ._cpp import SOURCE_META_BYTES

NVL_PEERS = 8  # DeepEP's send_nvl_head width


class DeepEPHandle(tuple):
    """A DeepEP handle tuple; ``.deepcomm`` is the deepcomm handle behind it."""

    def __new__(cls, items, deepcomm_handle):
        obj = super().__new__(cls, items)
        obj.deepcomm = deepcomm_handle
        return obj


class HandleRegistry:
    """deepcomm handles by the identity of one tensor of their DeepEP tuple, forgotten when that tensor dies."""

    def __init__(self) -> None:
        self._entries = {}

    def add(self, key: torch.Tensor, handle) -> None:
        k, entries = id(key), self._entries
        entries[k] = (weakref.ref(key, lambda _ref: entries.pop(k, None)), handle)

    def find(self, key) -> Optional[object]:
        entry = self._entries.get(id(key))
        return entry[1] if entry is not None and entry[0]() is key else None


KEY_ITEM = {"intranode": 0, "internode": 6, "low_latency": 1}
LENGTH = {"intranode": 6, "internode": 10, "low_latency": 5}


def resolve(handle, kind: str, registry: HandleRegistry, name: str = "handle"):
    """The deepcomm handle behind a DeepEP handle of ``kind`` (a deepcomm handle passes as is)."""
    want = LowLatencyHandle if kind == "low_latency" else Handle
    if isinstance(handle, want):
        return handle
    found = getattr(handle, "deepcomm", None) if isinstance(handle, DeepEPHandle) else None
    if found is None and isinstance(handle, (tuple, list)) and len(handle) == LENGTH[kind]:
        found = registry.find(handle[KEY_ITEM[kind]])
    if not isinstance(found, want):
        raise ValueError(f"{name}: expected the {kind.replace('_', '-')} handle a dispatch of this Buffer returned "
                         f"(a {LENGTH[kind]}-tuple), got {type(handle).__name__}")
    return found


def _channel_counts(mask: torch.Tensor, num_channels: int) -> torch.Tensor:
    """int32 ``[C, R]``: tokens of each channel (DeepEP's contiguous ranges of ceil(T / C)) with the mask set."""
    num_tokens, cols = mask.shape
    per = -(-num_tokens // num_channels)
    padded = torch.zeros(num_channels * per, cols, dtype=torch.int32, device=mask.device)
    padded[:num_tokens] = mask.to(torch.int32)
    return padded.view(num_channels, per, cols).sum(dim=1, dtype=torch.int32)


def _node_mask(mask: torch.Tensor, gpus_per_node: int) -> torch.Tensor:
    return mask.view(mask.shape[0], mask.shape[1] // gpus_per_node, gpus_per_node).any(dim=2)


def intranode(h: Handle, num_channels: int) -> tuple:
    mask = h.is_token_in_rank
    counts = _channel_counts(mask, num_channels)                         # [C, R]
    channel_prefix = counts.cumsum(dim=0, dtype=torch.int32)              # inclusive, per destination
    exclusive = channel_prefix - counts
    per = max(1, -(-mask.shape[0] // num_channels))
    channel_of = torch.arange(mask.shape[0], device=mask.device) // per
    send_head = torch.where(mask, h.send_pos - exclusive[channel_of], torch.full_like(h.send_pos, -1))
    world = mask.shape[1]
    return (h.count_matrix.cumsum(dim=0, dtype=torch.int32), channel_prefix.t().contiguous(),
            torch.full((world, num_channels), -1, dtype=torch.int32, device=mask.device),
            h.recv_src_idx, mask, send_head.to(torch.int32).contiguous())


def internode(h: Handle, num_channels: int, rank: int, gpus_per_node: int) -> tuple:
    mask, device = h.is_token_in_rank, h.is_token_in_rank.device
    world = mask.shape[1]
    nodes = world // gpus_per_node
    node_mask = _node_mask(mask, gpus_per_node)
    rdma_channel_prefix = _channel_counts(node_mask, num_channels).cumsum(dim=0, dtype=torch.int32).t()
    gbl_channel_prefix = _channel_counts(mask, num_channels).cumsum(dim=0, dtype=torch.int32).t()
    recv_gbl = h.count_matrix[:, rank].cumsum(dim=0, dtype=torch.int32)
    if h.node_count_matrix is not None:  # tokens rail peers of each node send to this rank's node, once each
        local = rank % gpus_per_node
        rails = torch.arange(nodes, device=device) * gpus_per_node + local
        recv_rdma = h.node_count_matrix[rails, rank // gpus_per_node].cumsum(dim=0, dtype=torch.int32)
        rdma_recv_tokens = int(recv_rdma[-1]) if nodes else 0
    else:
        recv_rdma = torch.full((nodes,), -1, dtype=torch.int32, device=device)
        rdma_recv_tokens = h.num_recv
    # source meta: (source node, -1): the node of each row's source rank is known, its NVLink bits are not
    src_rank = torch.repeat_interleave(torch.arange(world, device=device), h.count_matrix[:, rank].long(),
                                       output_size=int(h.count_matrix[:, rank].sum()))
    meta = torch.full((h.num_recv, SOURCE_META_BYTES // 4), -1, dtype=torch.int32, device=device)
    meta[:src_rank.numel(), 0] = (src_rank // gpus_per_node).to(torch.int32)

    def unknown(*shape):
        return torch.full(shape, -1, dtype=torch.int32, device=device)

    return (mask, rdma_channel_prefix.contiguous(), gbl_channel_prefix.contiguous(), unknown(nodes, num_channels),
            recv_rdma, unknown(world, num_channels), recv_gbl, meta.view(torch.uint8),
            unknown(mask.shape[0], nodes), unknown(rdma_recv_tokens, NVL_PEERS))


def layout_range_of(h: LowLatencyHandle, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 ``[L, R]``: ``begin << 32 | count`` of each source rank's rows at each local expert."""
    begin, count = h.layout[..., 0].to(torch.int64), h.layout[..., 1].to(torch.int64)
    packed = (begin << 32) | (count & 0xFFFFFFFF)
    if out is None:
        return packed
    return out.copy_(packed)


def low_latency(h: LowLatencyHandle, layout_range: torch.Tensor) -> tuple:
    return (h.src_info, layout_range, h.num_max_dispatch_tokens_per_rank, h.hidden, h.num_experts)
