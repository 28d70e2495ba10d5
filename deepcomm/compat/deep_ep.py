"""DeepEP V1's Python surface (``deep_ep.Buffer``, ``Config``, ``EventOverlap``) on top of ``deepcomm.Buffer``.

Code written against DeepEP V1 runs unchanged after ``import deepcomm.compat.deep_ep as deep_ep`` (or
``deepcomm.compat.install_deep_ep()``, which makes ``import deep_ep`` resolve here): same constructor arguments,
method names, argument names and order, and return tuples. Every call is one call of ``deepcomm.Buffer``, so the
results are exactly deepcomm's (the tests check it) and every backend works, the CPU reference backend included.

Where DeepEP's semantics differ, this module does the following (also listed in docs/api.md, "DeepEP compatibility"):

- Sizing. ``num_nvl_bytes`` / ``num_rdma_bytes`` are recorded but do not size anything: deepcomm sizes its buffers
  from ``max_tokens_per_rank`` and ``hidden`` (keyword-only extras of the constructor, defaults 4096 and 7168),
  and low-latency calls are capped by ``num_max_low_latency_tokens`` (default 128). ``Config.get_nvl_buffer_size_hint``
  returns deepcomm's NVLink buffer size at 4096 tokens per rank (0 without the extension);
  ``get_rdma_buffer_size_hint`` returns 0 (no RDMA buffer yet); ``get_low_latency_rdma_size_hint`` estimates the
  receive buffers of low-latency mode.
- Handles are opaque. Normal mode returns a ``deepcomm.Handle`` instead of DeepEP's tuple of prefix matrices;
  low-latency mode returns a ``deepcomm.LowLatencyHandle`` instead of ``(src_info, layout_range, M, hidden,
  num_experts)``. Pass them back unchanged; do not unpack them.
- Routing. A fresh ``dispatch`` derives the route from ``topk_idx`` (required) and takes ``num_experts`` from
  ``num_tokens_per_expert.numel()``; ``num_tokens_per_rank``, ``num_tokens_per_rdma_rank`` and ``is_token_in_rank``
  are accepted and not read (they are what ``get_dispatch_layout`` returned for the same ``topk_idx``).
- ``num_worst_tokens > 0`` is deepcomm's worst-case-size dispatch (no host sync, CUDA-graph capturable): outputs
  have that many rows, the first ``N`` defined; the per-expert list is empty, as in DeepEP (deepcomm's own call
  returns an int32 tensor instead).
- Streams: ``previous_event`` and ``async_finish`` map onto deepcomm's (the event returned is ``Buffer.event``, recorded
  at the end of the call on the communication stream); ``allocate_on_comm_stream`` is ignored. Low-latency calls
  and the reference backend finish in stream order (their events are recorded on the current stream / already
  reached on the CPU).
- ``num_sms``: ``Buffer.num_sms`` defaults to 24 (deepcomm's choice for H100/H200; DeepEP: 20) and ``config.num_sms``
  (or ``Buffer.num_sms`` when ``config`` is ``None``) is applied to the deepcomm Buffer before each normal-mode call.
  The chunk sizes of ``Config`` are recorded and not used (deepcomm's kernels have no chunked ring buffers).
- Low-latency: ``round_scale`` gives power-of-two fp32 scales; ``use_ue8m0`` packs them into int32 ``[.., H/512]``
  (needs ``H % 512 == 0``); scales are stored column-major in the last two dimensions like DeepEP's.
  ``use_logfmt`` is accepted and the combine stays BF16; ``zero_copy`` is accepted (``x`` is read either way);
  the ``*_wait_recv_cost_stats`` tensors are left untouched; ``cumulative_local_expert_recv_stats`` is updated.
  ``hook`` is ``None`` unless ``return_recv_hook=True`` (as in DeepEP).
- ``combine(bias=...)`` adds the bias (or the pair's sum) to the combined rows after the combine, in fp32 with one
  rounding, whereas DeepEP adds it inside the reduction.
- ``get_local_buffer_tensor`` raises ``NotImplementedError`` (deepcomm does not expose its raw buffers);
  ``destroy()`` works whether or not ``explicitly_destroy`` was set; ``comm`` (an mpi4py communicator) is refused:
  initialise torch.distributed from MPI instead (``deepcomm.launch_mpi``).
"""
from __future__ import annotations

import socket
from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .. import fp8 as _fp8
from .._ext import load_extension
from ..buffer import Buffer as _DeepcommBuffer
from ..config import DEFAULT_HIDDEN
from ..handle import Handle, LowLatencyHandle

topk_idx_t = torch.int64  # dtype of topk_idx (DeepEP exports this name)

_HINT_TOKENS = 4096  # tokens per rank behind Config.get_nvl_buffer_size_hint


def _fail(name: str, message: str):
    raise ValueError(f"{name}: {message}")


# ---- events ------------------------------------------------------------------------------------------------
class EventHandle:
    """A point in stream order: a ``torch.cuda.Event`` (``cuda_event``; by default one recorded on the current
    stream now), or on the CPU a point that is already reached (``cuda_event`` is ``None``)."""

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


class EventOverlap:
    """DeepEP's event wrapper: ``current_stream_wait()``, and ``with event: ...`` waits on exit.
    ``extra_tensors`` keeps tensors alive until the wrapper dies (DeepEP's graph-friendly ``record_stream``)."""

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is None:
            raise RuntimeError("EventOverlap.current_stream_wait: no event (the call was made with async_finish=False)")
        self.event.current_stream_wait()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


# ---- config ------------------------------------------------------------------------------------------------
class Config:
    """DeepEP's performance config. deepcomm uses ``num_sms``; the chunk sizes are kept for code that reads them."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        for name, value in (("num_sms", num_sms),
                            ("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens),
                            ("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens),
                            ("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens),
                            ("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                _fail(name, f"expected a positive int, got {value!r}")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of deepcomm's per-GPU NVLink buffer for bf16 rows of ``hidden_bytes`` at 4096 tokens per rank
        (0 when the extension is not built). Informational: the compat Buffer does not size from it."""
        from ..sizing import nvl_buffer_bytes
        hidden = max(8, (hidden_bytes // 2 + 7) // 8 * 8)
        got = nvl_buffer_bytes(num_ranks, _HINT_TOKENS, hidden) if num_ranks > 0 else None
        return 0 if got is None else got["total"]

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: deepcomm's normal mode holds no RDMA buffer yet."""
        return 0

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, nvl_chunk=({self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}), rdma_chunk=({self.num_max_rdma_chunked_send_tokens}, "
                f"{self.num_max_rdma_chunked_recv_tokens}))")


# ---- the buffer --------------------------------------------------------------------------------------------
class Buffer:
    """DeepEP V1's ``deep_ep.Buffer`` over a ``deepcomm.Buffer`` (``.runtime``). See the module docstring."""

    num_sms: int = 24

    def __init__(self, group: Optional[dist.ProcessGroup] = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, comm=None, *, max_tokens_per_rank: int = 4096,
                 hidden: Optional[int] = None, num_max_low_latency_tokens: int = 128, backend: str = "auto",
                 timeout_s: Optional[float] = None) -> None:
        if group is None and comm is not None:
            _fail("comm", "deepcomm needs a torch.distributed process group; initialise torch.distributed from MPI "
                          "(python -m deepcomm.launch_mpi) and pass group=")
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes),
                            ("num_qps_per_rank", num_qps_per_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                _fail(name, f"expected a non-negative int, got {value!r}")
        self.runtime = _DeepcommBuffer(group, max_tokens_per_rank=max_tokens_per_rank,
                                       hidden=DEFAULT_HIDDEN if hidden is None else hidden,
                                       backend=backend, num_max_low_latency_tokens=num_max_low_latency_tokens,
                                       timeout_s=timeout_s)
        self.group = self.runtime.group
        self.rank = self.runtime.rank
        self.group_size = self.runtime.world_size
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode, self.allow_mnnvl = allow_nvlink_for_low_latency_mode, allow_mnnvl
        self.explicitly_destroy = explicitly_destroy
        # nodes: ranks grouped by host; DeepEP's "RDMA ranks" are the nodes (contiguous, equal-sized groups)
        hosts: List[str] = [None] * self.group_size  # type: ignore[list-item]
        dist.all_gather_object(hosts, socket.gethostname(), group=self.group)
        self.num_rdma_ranks = len(set(hosts))
        per_node = self.group_size // self.num_rdma_ranks
        contiguous = self.group_size % self.num_rdma_ranks == 0 and all(
            hosts[i] == hosts[i // per_node * per_node] for i in range(self.group_size))
        self._nvl_ranks = per_node if contiguous else None
        self._combine_buffers = {}

    @property
    def buffer(self) -> _DeepcommBuffer:
        """The underlying ``deepcomm.Buffer``."""
        return self.runtime

    # ---- static helpers ----
    @staticmethod
    def is_sm90_compiled() -> bool:
        return load_extension() is not None

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int) or new_num_sms < 2 or new_num_sms % 2:
            _fail("new_num_sms", f"expected an even int >= 2, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Estimated bytes of low-latency receive buffers, double-buffered: dispatch ``[E/R, R*M]`` rows of bf16
        + fp32 scales + 16 bytes of metadata, and combine ``[E/R, R*M]`` bf16 rows (the shapes of docs/api.md)."""
        m, e = num_max_dispatch_tokens_per_rank, num_experts
        if min(m, hidden, num_ranks, e) < 1:
            _fail("num_max_dispatch_tokens_per_rank", "all sizes must be positive")
        dispatch_row = hidden * 2 + (hidden + 127) // 128 * 4 + 16
        per_buffer = e * m * dispatch_row + e * m * hidden * 2
        return 2 * ((per_buffer + 127) // 128 * 128)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """``Config(Buffer.num_sms, ...)`` for any rank count (deepcomm has no per-rank-count tuning table)."""
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            _fail("num_ranks", f"expected a positive int, got {num_ranks!r}")
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            _fail("num_ranks", f"expected a positive int, got {num_ranks!r}")
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    # ---- plumbing ----
    def get_comm_stream(self):
        """The CUDA backend's communication stream; the current stream otherwise (``None`` on the CPU)."""
        stream = getattr(getattr(self.runtime, "_backend", None), "comm_stream", None)
        if stream is not None:
            return stream
        return torch.cuda.current_stream() if self.runtime.device.type == "cuda" else None

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        raise NotImplementedError("deepcomm does not expose its raw communication buffers")

    def destroy(self) -> None:
        self.runtime.destroy()

    def _before(self, previous_event: Optional[EventOverlap], config: Optional[Config]):
        """Apply the config's num_sms; returns the ``torch.cuda.Event`` of ``previous_event`` (or ``None``)."""
        if config is not None and not isinstance(config, Config):
            _fail("config", f"expected a deep_ep Config, got {type(config).__name__}")
        num_sms = config.num_sms if config is not None else Buffer.num_sms
        if num_sms != self.runtime.num_sms:
            self.runtime.set_num_sms(num_sms)
        if previous_event is None:
            return None
        if not isinstance(previous_event, EventOverlap):
            _fail("previous_event", f"expected an EventOverlap, got {type(previous_event).__name__}")
        return None if previous_event.event is None else previous_event.event.cuda_event

    def _event(self, async_finish: bool, extra=None, comm_event=False) -> EventOverlap:
        """``comm_event``: the call ran on deepcomm's communication stream; its end is ``runtime.event``."""
        if not async_finish:
            return EventOverlap(None)
        ev = self.runtime.event if comm_event else None
        return EventOverlap(EventHandle(self.runtime.device, ev), extra)

    # ---- layout ----
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """``(num_tokens_per_rank [R], num_tokens_per_rdma_rank [nodes] or None on one node,
        num_tokens_per_expert [E], is_token_in_rank [T, R], event)``."""
        if previous_event is not None and previous_event.event is not None:
            previous_event.event.current_stream_wait()  # the layout runs on the current stream
        per_rank, per_expert, in_rank = self.runtime.get_dispatch_layout(topk_idx, num_experts)
        per_rdma_rank = None
        if self.num_rdma_ranks > 1 and self._nvl_ranks is not None:
            per_rdma_rank = in_rank.view(in_rank.shape[0], self.num_rdma_ranks, self._nvl_ranks).any(2) \
                .sum(0, dtype=torch.int32)
        return per_rank, per_rdma_rank, per_expert, in_rank, self._event(async_finish)

    # ---- normal mode ----
    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], handle: Optional[Handle] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``; with a
        ``handle`` (cached route): ``(recv_x, None, None, None, None, event)``."""
        prev = self._before(previous_event, config)
        stream = dict(previous_event=prev, async_finish=async_finish)
        if handle is not None:
            if not isinstance(handle, Handle):
                _fail("handle", f"expected the handle dispatch returned, got {type(handle).__name__}")
            if topk_idx is not None or topk_weights is not None:
                _fail("topk_idx" if topk_idx is not None else "topk_weights",
                      "must be None when a handle is given (cached dispatch)")
            recv_x, _, _, _, _ = self.runtime.dispatch(x, handle=handle, expert_alignment=expert_alignment, **stream)
            return recv_x, None, None, None, None, self._event(async_finish, comm_event=True)
        if topk_idx is None:
            _fail("topk_idx", "required when no handle is given (deepcomm derives the route from it)")
        if num_tokens_per_expert is None:
            _fail("num_tokens_per_expert", "required when no handle is given (from get_dispatch_layout)")
        recv_x, recv_idx, recv_w, counts, out_handle = self.runtime.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_tokens_per_expert.numel(),
            expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens, **stream)
        if num_worst_tokens:
            counts = []  # DeepEP: no per-expert list in the worst-case form
        return recv_x, recv_idx, recv_w, counts, out_handle, self._event(async_finish, comm_event=True)

    def combine(self, x: torch.Tensor, handle: Handle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """``(combined_x, combined_topk_weights, event)``: rows summed back to their source tokens (no weights)."""
        prev = self._before(previous_event, config)
        combined_x, combined_w = self.runtime.combine(x, handle, topk_weights=topk_weights, previous_event=prev,
                                                      async_finish=async_finish and bias is None)
        if bias is not None:
            parts = bias if isinstance(bias, tuple) else (bias,)
            acc = combined_x.float()
            for i, b in enumerate(parts):
                if b is not None:
                    if not isinstance(b, torch.Tensor) or tuple(b.shape) != tuple(combined_x.shape):
                        _fail(f"bias[{i}]" if isinstance(bias, tuple) else "bias",
                              f"expected a tensor of shape {tuple(combined_x.shape)}")
                    acc = acc + b.float()
            combined_x = acc.to(combined_x.dtype)  # on the current stream, after the combine
        return combined_x, combined_w, self._event(async_finish, comm_event=bias is None)

    internode_dispatch = dispatch
    internode_combine = combine

    # ---- low-latency mode ----
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Nothing to clean: deepcomm's low-latency path keeps no state between calls."""

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """``(recv_x, recv_count, handle, event, hook)``; ``recv_x`` is ``(e4m3 [L, R*M, H], scales)`` with
        ``use_fp8`` (scales fp32 ``[L, R*M, H/128]``, or int32 ``[L, R*M, H/512]`` with ``use_ue8m0``), else bf16."""
        if use_ue8m0 and not round_scale:
            _fail("use_ue8m0", "needs round_scale=True (as in DeepEP)")
        if use_fp8 and use_ue8m0 and x.shape[-1] % 512 != 0:
            _fail("x", f"use_ue8m0 packs 4 scales per int32: hidden must be a multiple of 512, got {x.shape[-1]}")
        recv_x, recv_count, handle, hook = self.runtime.low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=use_fp8,
            use_ue8m0=bool(round_scale), return_recv_hook=return_recv_hook)
        if use_fp8:
            values, scales = recv_x
            L, rows, groups = scales.shape
            if use_ue8m0:  # column-major in the last two dims, like DeepEP's TMA-friendly scales
                out_scales = torch.empty(L, groups // 4, rows, dtype=torch.int32, device=scales.device).transpose(1, 2)
            else:
                out_scales = torch.empty(L, groups, rows, dtype=torch.float32, device=scales.device).transpose(1, 2)
            result = (values, out_scales)
        else:
            scales, out_scales, result = None, None, recv_x

        def finish():
            if scales is not None:
                out_scales.copy_(_fp8.pack_ue8m0(scales) if use_ue8m0 else scales)
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(recv_count.to(cumulative_local_expert_recv_stats.dtype))

        done = []

        def recv_hook():
            if not done:
                hook()
                finish()
                done.append(True)

        if not return_recv_hook:
            recv_hook()
        extra = (x, topk_idx) + tuple(t for t in (result if isinstance(result, tuple) else (result,))) \
            if async_finish else None
        return result, recv_count, handle, self._event(async_finish, extra), (recv_hook if return_recv_hook else None)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: LowLatencyHandle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """``(combined_x bf16 [T, H], event, hook)``: each token's expert outputs summed with its weights."""
        combined, hook = self.runtime.low_latency_combine(x, topk_idx, topk_weights, handle,
                                                          return_recv_hook=return_recv_hook)
        if out is not None:
            if not isinstance(out, torch.Tensor) or out.shape != combined.shape or out.dtype != combined.dtype:
                _fail("out", f"expected a {combined.dtype} tensor of shape {tuple(combined.shape)}")
        result = combined if out is None else out
        done = []

        def recv_hook():
            if not done:
                hook()
                if out is not None:
                    out.copy_(combined)
                done.append(True)

        if not return_recv_hook:
            recv_hook()
        extra = (x, topk_idx, topk_weights, result) if async_finish else None
        return result, self._event(async_finish, extra), (recv_hook if return_recv_hook else None)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """A bf16 ``[L, R*M, H]`` tensor to write expert outputs into and pass as ``x`` of ``low_latency_combine``
        (one per shape, reused by later calls; ``zero_copy`` makes no difference here)."""
        if not isinstance(handle, LowLatencyHandle):
            _fail("handle", f"expected a low-latency handle, got {type(handle).__name__}")
        L = handle.num_experts // self.group_size
        shape = (L, self.group_size * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        if shape not in self._combine_buffers:
            self._combine_buffers[shape] = torch.empty(shape, dtype=torch.bfloat16, device=self.runtime.device)
        return self._combine_buffers[shape]

    def __repr__(self) -> str:
        return f"deep_ep.Buffer(compat over {self.runtime!r})"


__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t"]
