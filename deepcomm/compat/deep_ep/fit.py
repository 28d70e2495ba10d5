"""Whether a call would fit DeepEP V1's buffers of ``num_nvl_bytes`` / ``num_rdma_bytes`` (its host asserts).

DeepEP streams normal-mode rows through per-channel ring buffers, so the token count never matters there: what
must fit is ``config.num_sms / 2`` channels x ranks x ``num_max_nvl_chunked_recv_tokens`` rows of (hidden, source
index, top-k, scales) (csrc/deep_ep.cpp, intranode_dispatch / intranode_combine). Several NVLink domains (more than
8 ranks) use its size hints instead, which its internode kernels carve. Low-latency mode needs its
LowLatencyLayout for (M, hidden, experts) in ``num_rdma_bytes``. A call that would not fit raises ValueError
naming the byte count DeepEP would have needed more of; deepcomm's own buffers are sized apart (sizes.py).
"""
from __future__ import annotations

from ._cpp import NUM_MAX_NVL_PEERS, Config, low_latency_layout_bytes

INT_BYTES, TOPK_ID_BYTES, FLOAT_BYTES = 4, 8, 4


def _short(name: str, need: int, have: int, what: str):
    raise ValueError(f"{name}: DeepEP needs {need} bytes for {what}, the Buffer was given {have} "
                     f"(Config.get_nvl_buffer_size_hint / get_rdma_buffer_size_hint, or "
                     f"Buffer.get_low_latency_rdma_size_hint, give DeepEP's sizes)")


def _internode(config: Config, hidden_bytes: int, num_ranks: int, num_nvl_bytes: int, num_rdma_bytes: int,
               what: str) -> None:
    nvl = config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)
    if nvl > num_nvl_bytes:
        _short("num_nvl_bytes", nvl, num_nvl_bytes, what)
    rdma = config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks)
    if rdma > num_rdma_bytes:
        _short("num_rdma_bytes", rdma, num_rdma_bytes, what)


def check_dispatch(config: Config, num_ranks: int, num_experts: int, hidden: int, element_size: int,
                   num_topk: int, num_scales: int, num_nvl_bytes: int, num_rdma_bytes: int) -> None:
    """A normal-mode dispatch (fresh when ``num_experts``, else cached) of rows ``hidden`` x ``element_size``
    bytes with ``num_topk`` top-k slots and ``num_scales`` FP8 scales."""
    what = f"this dispatch (hidden {hidden}, {config.num_sms} SMs, {config.num_max_nvl_chunked_recv_tokens}-token chunks)"
    if num_ranks > NUM_MAX_NVL_PEERS:
        return _internode(config, hidden * element_size, num_ranks, num_nvl_bytes, num_rdma_bytes, what)
    channels, chunk = config.num_sms // 2, config.num_max_nvl_chunked_recv_tokens
    slots = channels * num_ranks * chunk
    need = (num_ranks * num_ranks * INT_BYTES + 4 * channels * num_ranks * INT_BYTES
            + slots * (hidden * element_size + INT_BYTES + num_topk * (TOPK_ID_BYTES + FLOAT_BYTES)
                       + num_scales * FLOAT_BYTES))
    if num_experts:  # the notify step's per-rank and per-expert counts
        need = max(need, num_ranks * (num_ranks + num_experts // num_ranks) * INT_BYTES)
    if need > num_nvl_bytes:
        _short("num_nvl_bytes", need, num_nvl_bytes, what)


def check_combine(config: Config, num_ranks: int, hidden: int, element_size: int, num_topk: int,
                  num_nvl_bytes: int, num_rdma_bytes: int) -> None:
    what = f"this combine (hidden {hidden}, {config.num_sms} SMs, {config.num_max_nvl_chunked_recv_tokens}-token chunks)"
    if num_ranks > NUM_MAX_NVL_PEERS:
        return _internode(config, hidden * element_size, num_ranks, num_nvl_bytes, num_rdma_bytes, what)
    channels, chunk = config.num_sms // 2, config.num_max_nvl_chunked_recv_tokens
    need = (2 * channels * num_ranks * INT_BYTES
            + channels * num_ranks * chunk * (hidden * element_size + INT_BYTES + num_topk * FLOAT_BYTES))
    if need > num_nvl_bytes:
        _short("num_nvl_bytes", need, num_nvl_bytes, what)


def check_low_latency(num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int,
                      num_rdma_bytes: int) -> None:
    need = low_latency_layout_bytes(num_max_dispatch_tokens_per_rank, hidden, num_experts)["total"]
    if need > num_rdma_bytes:
        _short("num_rdma_bytes", need, num_rdma_bytes,
               f"low-latency calls of num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}, "
               f"hidden {hidden}, {num_experts} experts")


def max_low_latency_tokens(num_rdma_bytes: int, num_ranks: int) -> int:
    """The largest ``num_max_dispatch_tokens_per_rank`` any low-latency call can have within ``num_rdma_bytes``
    (at the smallest shape: hidden 128, one expert per rank; the layout grows linearly with it); at least 1."""
    per_token = low_latency_layout_bytes(1, 128, num_ranks)["total"] - low_latency_layout_bytes(0, 128, num_ranks)["total"]
    fixed = low_latency_layout_bytes(0, 128, num_ranks)["total"]
    return max(1, (num_rdma_bytes - fixed) // per_token)
