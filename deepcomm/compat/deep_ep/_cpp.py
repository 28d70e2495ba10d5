"""What DeepEP V1's compiled module ``deep_ep_cpp`` gives Python: ``Buffer`` (the runtime class of
``deep_ep.Buffer.runtime``, runtime.py), ``Config``, ``EventHandle``, ``topk_idx_t``,
``get_low_latency_rdma_size_hint`` and ``is_sm90_compiled``. ``install_deep_ep()`` registers this module as
``deep_ep_cpp``."""
from __future__ import annotations

from typing import Optional

import torch

from ..._ext import load_extension
from .runtime import Runtime as Buffer

topk_idx_t = torch.int64  # dtype of top-k expert ids (DeepEP's default build)

NUM_MAX_NVL_PEERS = 8             # DeepEP's GPUs per NVLink domain (csrc/kernels/configs.cuh)
NUM_BUFFER_ALIGNMENT_BYTES = 128
SOURCE_META_BYTES = 8             # DeepEP's internode SourceMeta: (src_rdma_rank, is_token_in_nvl_rank_bits)
_MAX_TOPK, _MAX_SCALES = 128, 128  # the size hints' assumptions (csrc/config.hpp)


def _fail(name: str, message: str):
    raise ValueError(f"{name}: {message}")


def _align_up(a: int, b: int) -> int:
    return (a + b - 1) // b * b


class Config:
    """DeepEP's performance config, with DeepEP's checks (``ValueError`` naming the field instead of an assert).
    deepcomm applies ``num_sms`` before each normal-mode call; the chunk sizes size DeepEP's ring buffers, which
    deepcomm does not have: they are kept (readable) and feed the size hints, as in DeepEP."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        for name, value in (("num_sms", num_sms),
                            ("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens),
                            ("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens),
                            ("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens),
                            ("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens)):
            if isinstance(value, bool) or not isinstance(value, int):
                _fail(name, f"expected an int, got {type(value).__name__}")
            if value < (0 if name == "num_sms" else 1):
                _fail(name, f"expected {'>= 0' if name == 'num_sms' else '> 0'}, got {value}")
        if num_max_nvl_chunked_send_tokens >= num_max_nvl_chunked_recv_tokens:
            _fail("num_max_nvl_chunked_send_tokens", "must be less than num_max_nvl_chunked_recv_tokens")
        rdma_recv = _align_up(num_max_rdma_chunked_recv_tokens, num_max_rdma_chunked_send_tokens)
        if num_max_rdma_chunked_send_tokens > rdma_recv // 2:
            _fail("num_max_rdma_chunked_send_tokens", "must be at most half of num_max_rdma_chunked_recv_tokens")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = rdma_recv  # rounded up to the send chunk, as DeepEP does

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's NVLink buffer bytes for this config (its formula; deepcomm sizes its own buffers)."""
        if not (num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0):
            _fail("num_ranks", f"expected < {NUM_MAX_NVL_PEERS} or a multiple of it, got {num_ranks}")
        if num_ranks > NUM_MAX_NVL_PEERS and self.num_sms % 2:
            _fail("num_sms", "must be even for more than one node")
        rdma_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1)
        nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        per_slot = nvl_ranks * (self.num_sms // 2)
        tokens = per_slot * self.num_max_nvl_chunked_recv_tokens
        num_bytes = per_slot * (2 * rdma_ranks + 3) * 4
        num_bytes += tokens * (hidden_bytes + SOURCE_META_BYTES + _MAX_TOPK * 8 + _MAX_TOPK * 4 + _MAX_SCALES * 4)
        return _align_up(num_bytes, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's RDMA buffer bytes for this config: 0 on one NVLink domain (up to 8 ranks)."""
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        if num_ranks % NUM_MAX_NVL_PEERS:
            _fail("num_ranks", f"expected a multiple of {NUM_MAX_NVL_PEERS}, got {num_ranks}")
        if self.num_sms % 2:
            _fail("num_sms", "must be even")
        per_slot = (num_ranks // NUM_MAX_NVL_PEERS) * (self.num_sms // 2)
        tokens = per_slot * self.num_max_rdma_chunked_recv_tokens
        num_bytes = per_slot * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        num_bytes += tokens * 2 * (hidden_bytes + SOURCE_META_BYTES + _MAX_TOPK * 8 + _MAX_TOPK * 4
                                   + _MAX_SCALES * 4 + 16)
        return _align_up(num_bytes, 128)

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, nvl_chunk=({self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}), rdma_chunk=({self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens}))")


def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                   num_experts: int) -> int:
    """DeepEP's low-latency buffer bytes (its layout's formula; deepcomm sizes its own buffer at the first call)."""
    for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden),
                        ("num_ranks", num_ranks), ("num_experts", num_experts)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            _fail(name, f"expected a positive int, got {value!r}")
    total = low_latency_layout_bytes(num_max_dispatch_tokens_per_rank, hidden, num_experts)["total"]
    return (total + NUM_BUFFER_ALIGNMENT_BYTES) // NUM_BUFFER_ALIGNMENT_BYTES * NUM_BUFFER_ALIGNMENT_BYTES


def low_latency_layout_bytes(num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> dict:
    """DeepEP's LowLatencyLayout (csrc/config.hpp): ``total`` bytes of its two (odd/even) sets of send, receive and
    signalling buffers, and ``signaling`` bytes of one signalling buffer (128-aligned; the two come first)."""
    m, e = num_max_dispatch_tokens_per_rank, num_experts
    num_scales = hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + num_scales * 4)
    combine_msg = num_scales * 4 + hidden * 2
    send = max(m * dispatch_msg, e * m * combine_msg)
    recv = max(e * m * dispatch_msg, e * m * combine_msg)
    signaling = _align_up(e * 4, 128)
    return {"total": 2 * (send + recv + signaling), "signaling": signaling}


def is_sm90_compiled() -> bool:
    """Whether deepcomm's CUDA extension is built (its kernels cover SM90)."""
    return load_extension() is not None


class EventHandle:
    """A point in stream order: a ``torch.cuda.Event`` (``cuda_event``; by default one recorded on the current
    stream now, as DeepEP's ``EventHandle()``), or on the CPU a point already reached (``cuda_event`` is None)."""

    def __init__(self, device: Optional[torch.device] = None, cuda_event: Optional["torch.cuda.Event"] = None):
        self.cuda_event = cuda_event
        if cuda_event is not None:
            return
        if device is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.device("cuda", torch.cuda.current_device())
        if device is not None and device.type == "cuda":
            self.cuda_event = torch.cuda.Event()
            self.cuda_event.record(torch.cuda.current_stream(device))

    def current_stream_wait(self) -> None:
        if self.cuda_event is not None:
            torch.cuda.current_stream().wait_event(self.cuda_event)


def __getattr__(name: str):
    raise AttributeError(f"deep_ep_cpp (deepcomm's DeepEP shim) has no {name!r}: deepcomm provides Buffer, Config, "
                         f"EventHandle, topk_idx_t, get_low_latency_rdma_size_hint and is_sm90_compiled")


__all__ = ["Buffer", "Config", "EventHandle", "get_low_latency_rdma_size_hint", "is_sm90_compiled", "topk_idx_t"]
