"""``deep_ep.Buffer``: DeepEP V1's Buffer (normal, internode and low-latency mode) over a ``deepcomm.Buffer``.

Same names, arguments (order and defaults), return tuples and handle tuples as DeepEP V1 at 567632d; every call
is one or two calls of ``deepcomm.Buffer`` (``.buffer``; ``.runtime`` answers DeepEP's runtime queries), so every
deepcomm backend runs it, the CPU reference backend included. Where deepcomm cannot do what an argument value asks, the call raises ``ValueError`` naming the
argument. The differences are listed in docs/api.md, "DeepEP V1 drop-in".
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ... import fp8 as _fp8
from ...backends import cuda_unavailable_reason
from ...buffer import Buffer as _DeepcommBuffer
from . import fit as _fit
from . import handles as _h
from . import payload as _payload
from ._cpp import NUM_BUFFER_ALIGNMENT_BYTES, Config, EventHandle
from ._cpp import get_low_latency_rdma_size_hint as _ll_size_hint
from ._cpp import is_sm90_compiled as _is_sm90_compiled
from .runtime import Runtime
from .sizes import GrowingBuffer
from .utils import EventOverlap, check_nvlink_connections

Payload = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]
Bias = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]

# DeepEP's recommended configs by rank count (its buffer.py); other counts get _DEFAULT_CHUNKS
_DISPATCH_CHUNKS = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
                    96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128),
                    160: (28, 720, 12, 128)}
_COMBINE_CHUNKS = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                   24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
                   96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}
_DEFAULT_CHUNKS = (6, 256, 6, 128)


def _fail(name: str, message: str):
    raise ValueError(f"{name}: {message}")


# deepcomm's limits (start of its ValueError text) -> the keyword of deep_ep.Buffer that sets them
_LIMITS = (("tokens exceed max_tokens_per_rank=", "max_tokens_per_rank"),
           ("num_max_dispatch_tokens_per_rank: expected <=", "num_max_low_latency_tokens"))


def _name_size_keyword(method):
    """DeepEP streams any token count through its ring buffers; deepcomm's buffers hold a maximum, set by a
    keyword-only extra of this constructor or grown to what calls need (sizes.py). A call that meets a fixed one
    says which keyword set it (deepcomm has already told every rank that the call was refused, so the error is
    only reworded here)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except ValueError as exc:
            text = str(exc)
            for limit, keyword in _LIMITS:
                if limit in text:
                    if keyword == "max_tokens_per_rank" and not self._sizes.fixed_tokens:
                        raise ValueError(f"{text} (a dispatch with num_worst_tokens holds num_worst_tokens / "
                                         f"num_ranks tokens per rank; make a dispatch without it first, or pass "
                                         f"deep_ep.Buffer(..., max_tokens_per_rank=N))") from exc
                    raise ValueError(f"{text} (set by deep_ep.Buffer(..., {keyword}=N); deepcomm sizes its buffers "
                                     f"for that maximum)") from exc
            raise
    return call


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _fail(name, f"expected a positive int, got {value!r}")


class Buffer:
    """DeepEP V1's ``deep_ep.Buffer`` over a ``deepcomm.Buffer`` (``.buffer``; ``.runtime``: runtime.py).

    A call runs when it fits DeepEP's buffers of ``num_nvl_bytes`` / ``num_rdma_bytes`` (else ValueError naming
    them, fit.py); deepcomm's buffers are sized apart, growing to what calls need (sizes.py). Keyword-only extras
    fix deepcomm's sizes instead: ``max_tokens_per_rank`` and ``hidden`` (normal mode, and hidden in low-latency
    mode), ``num_max_low_latency_tokens`` (default: the most that ``num_rdma_bytes`` can hold); ``backend``,
    ``timeout_s`` and ``gpus_per_node`` go to ``deepcomm.Buffer``."""

    num_sms: int = 20

    def __init__(self,
                 group: Optional[dist.ProcessGroup],
                 num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False,
                 use_fabric: bool = False,
                 explicitly_destroy: bool = False,
                 enable_shrink: bool = False,
                 comm: Optional["mpi4py.MPI.Comm"] = None,  # noqa: F821
                 *, max_tokens_per_rank: Optional[int] = None, hidden: Optional[int] = None,
                 num_max_low_latency_tokens: Optional[int] = None, backend: str = "auto",
                 timeout_s: Optional[float] = None, gpus_per_node: Optional[int] = None) -> None:
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes),
                            ("num_qps_per_rank", num_qps_per_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                _fail(name, f"expected a non-negative int, got {value!r}")
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if value % NUM_BUFFER_ALIGNMENT_BYTES:
                _fail(name, f"expected a multiple of {NUM_BUFFER_ALIGNMENT_BYTES} (as DeepEP), got {value}")
        for name, value in (("low_latency_mode", low_latency_mode),
                            ("allow_nvlink_for_low_latency_mode", allow_nvlink_for_low_latency_mode),
                            ("allow_mnnvl", allow_mnnvl), ("use_fabric", use_fabric),
                            ("explicitly_destroy", explicitly_destroy), ("enable_shrink", enable_shrink)):
            if not isinstance(value, bool):
                _fail(name, f"expected a bool, got {type(value).__name__}")
        if use_fabric:
            _fail("use_fabric", "deepcomm's buffers are cudaMalloc memory shared with CUDA IPC (or NVSHMEM's heap); "
                                "fabric handles are not supported")
        if not allow_nvlink_for_low_latency_mode:
            _fail("allow_nvlink_for_low_latency_mode", "deepcomm's low-latency mode reaches peers on this node over "
                                                      "NVLink; it cannot be told not to")
        group = self._group_from(group, comm)
        check_nvlink_connections(group)
        if num_max_low_latency_tokens is None:
            # deepcomm sizes each low-latency buffer by its call's shape: the only limit left is DeepEP's own
            num_max_low_latency_tokens = _fit.max_low_latency_tokens(num_rdma_bytes, dist.get_world_size(group))

        def make(tokens: int, hidden_size: int, num_sms: Optional[int]) -> _DeepcommBuffer:
            return _DeepcommBuffer(group, max_tokens_per_rank=tokens, hidden=hidden_size, num_sms=num_sms,
                                   backend=_deep_ep_backend(backend),
                                   num_max_low_latency_tokens=num_max_low_latency_tokens, timeout_s=timeout_s,
                                   gpus_per_node=gpus_per_node)
        self._sizes = GrowingBuffer(make, max_tokens_per_rank, hidden)
        self._scratch = {}  # get_local_buffer_tensor's regions: use_rdma_buffer -> uint8 tensor
        self.runtime = Runtime._over(self)  # DeepEP's runtime queries, else deepcomm's Buffer
        self.group = self._dc.group
        self.rank = self._dc.rank
        self.group_size = self._dc.world_size
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode, self.allow_mnnvl = allow_nvlink_for_low_latency_mode, allow_mnnvl
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.nvshmem_qp_depth = int(os.environ.get('NVSHMEM_QP_DEPTH', '1024'))
        topo = self._dc.topology
        self.num_rdma_ranks = topo.num_nodes  # DeepEP's RDMA ranks: the nodes
        self._gpus_per_node = topo.gpus_per_node
        self._handles = _h.HandleRegistry()
        self._combine_buffers = {}

    @staticmethod
    def _group_from(group, comm):
        """DeepEP takes a process group, or an mpi4py communicator when there is none: deepcomm then runs on the
        default torch.distributed group, initialised from the communicator if needed."""
        if group is not None:
            return group
        if comm is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")
        if not (dist.is_available() and dist.is_initialized()):
            from ...launch_mpi import init_from_mpi
            init_from_mpi(comm)
        if dist.get_world_size() != comm.Get_size() or dist.get_rank() != comm.Get_rank():
            _fail("comm", f"rank {comm.Get_rank()} of {comm.Get_size()} does not match torch.distributed's default "
                          f"group (rank {dist.get_rank()} of {dist.get_world_size()})")
        return dist.group.WORLD

    @property
    def buffer(self) -> _DeepcommBuffer:
        """The ``deepcomm.Buffer`` new calls run on (a larger one replaces it when a call needs more: sizes.py)."""
        return self._sizes.current

    @property
    def _dc(self) -> _DeepcommBuffer:
        return self._sizes.current

    def _owner(self, dc_handle) -> _DeepcommBuffer:
        """The deepcomm.Buffer whose dispatch made ``dc_handle`` (its combine and cached dispatch run there)."""
        return self._sizes.owner(getattr(dc_handle, "buffer_id", None))

    def destroy(self):
        """Release the resources (also allowed without ``explicitly_destroy``; the destructor does it otherwise)."""
        self._sizes.destroy()
        self._scratch.clear()

    # ---- static helpers ----
    @staticmethod
    def is_sm90_compiled():
        return _is_sm90_compiled()

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
        return _ll_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def _unpack_bias(bias: Bias):
        if bias is None:
            return None, None
        if isinstance(bias, torch.Tensor):
            return bias, None
        if isinstance(bias, tuple) and len(bias) == 2:
            return bias
        _fail("bias", f"expected a tensor, a pair of tensors or None, got {type(bias).__name__}")

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended config for ``num_ranks`` (its table); other rank counts get DeepEP's default
        chunk sizes (DeepEP asserts there)."""
        _check_count("num_ranks", num_ranks)
        return Config(Buffer.num_sms, *_DISPATCH_CHUNKS.get(num_ranks, _DEFAULT_CHUNKS))

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        _check_count("num_ranks", num_ranks)
        return Config(Buffer.num_sms, *_COMBINE_CHUNKS.get(num_ranks, _DEFAULT_CHUNKS))

    # ---- plumbing ----
    def get_comm_stream(self) -> torch.Stream:
        """The CUDA backend's communication stream; the current stream otherwise (``None`` on the CPU)."""
        stream = getattr(getattr(self._dc, "_backend", None), "comm_stream", None)
        if stream is not None:
            return stream
        return torch.cuda.current_stream() if self._dc.device.type == "cuda" else None

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A ``dtype`` view of this rank's ``num_nvl_bytes`` region (``num_rdma_bytes`` with ``use_rdma_buffer``),
        from byte ``offset``: all of the rest, or the first ``size`` elements shaped ``size``. The region is this
        Buffer's own memory, allocated at the first call and the same on every call (what is written is read back
        later; ``clean_low_latency_buffer`` zeroes DeepEP's signalling words in it, as DeepEP does), but it is not
        the memory deepcomm's kernels communicate through: dispatch and combine neither read nor overwrite it."""
        if not isinstance(use_rdma_buffer, bool):
            _fail("use_rdma_buffer", f"expected a bool, got {type(use_rdma_buffer).__name__}")
        region = self._local_region(use_rdma_buffer)
        if not isinstance(dtype, torch.dtype):
            _fail("dtype", f"expected a torch.dtype, got {type(dtype).__name__}")
        element = torch.empty((), dtype=dtype).element_size()
        name = "num_rdma_bytes" if use_rdma_buffer else "num_nvl_bytes"
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= region.numel():
            _fail("offset", f"expected a byte offset in [0, {name}={region.numel()}], got {offset!r}")
        if offset % element:
            _fail("offset", f"expected a multiple of the {dtype} element size ({element} bytes), got {offset}")
        count = (region.numel() - offset) // element
        tensor = region[offset:offset + count * element].view(dtype)
        if size is None:
            return tensor
        if isinstance(size, int) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                            for d in size):
            _fail("size", f"expected a torch.Size (or a sequence of non-negative ints), got {size!r}")
        size = torch.Size(size)
        if size.numel() > count:
            _fail("size", f"{tuple(size)} is {size.numel()} elements of {dtype}; {name}={region.numel()} holds "
                          f"{count} from offset {offset}")
        return tensor[:size.numel()].view(size)

    def _local_region(self, use_rdma_buffer: bool) -> torch.Tensor:
        """The uint8 tensor behind get_local_buffer_tensor (``num_rdma_bytes`` or ``num_nvl_bytes`` long)."""
        region = self._scratch.get(use_rdma_buffer)
        if region is None:
            num_bytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
            region = torch.empty(num_bytes, dtype=torch.uint8, device=self._dc.device)
            self._scratch[use_rdma_buffer] = region
        return region

    def _before(self, dc: _DeepcommBuffer, previous_event: Optional[EventOverlap], config: Optional[Config],
                async_finish: bool, allocate_on_comm_stream: bool):
        """Checks the stream arguments, applies the config's num_sms to ``dc``; returns the ``torch.cuda.Event``
        of ``previous_event`` (or None)."""
        if not isinstance(config, Config):
            _fail("config", f"expected a deep_ep Config, got {type(config).__name__}")
        if config.num_sms < 2 or config.num_sms % 2:
            _fail("config", f"num_sms must be even and >= 2 (one channel is two SMs), got {config.num_sms}")
        if not isinstance(async_finish, bool):
            _fail("async_finish", f"expected a bool, got {type(async_finish).__name__}")
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            _fail("allocate_on_comm_stream", "needs previous_event and async_finish=True (as in DeepEP)")
        if config.num_sms != dc.num_sms:
            dc.set_num_sms(config.num_sms)
        if previous_event is None:
            return None
        if not isinstance(previous_event, EventOverlap):
            _fail("previous_event", f"expected an EventOverlap, got {type(previous_event).__name__}")
        return None if previous_event.event is None else previous_event.event.cuda_event

    @staticmethod
    def _comm_stream_if(dc: _DeepcommBuffer, async_finish: bool):
        """The stream on which results of a normal-mode call on ``dc`` are ready: its communication stream when
        the caller does not wait for it (``async_finish``), else the current stream; None on the CPU."""
        if dc.device.type != "cuda":
            return None
        comm = getattr(getattr(dc, "_backend", None), "comm_stream", None)
        return comm if async_finish and comm is not None else None

    def _event(self, async_finish: bool, extra=None, stream=None) -> EventOverlap:
        """``stream``: the call's last work is there (the communication stream); else the current stream."""
        if not async_finish:
            return EventOverlap(None)
        if stream is None:
            return EventOverlap(EventHandle(self._dc.device), extra)
        ev = torch.cuda.Event()
        ev.record(stream)
        return EventOverlap(EventHandle(self._dc.device, ev), extra)

    def _derived(self, stream):
        """Where the handle's derived tensors are computed: after the call, on the stream its results are on."""
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    # ---- layout ----
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """``(num_tokens_per_rank [R], num_tokens_per_rdma_rank [nodes] or None on one node,
        num_tokens_per_expert [E], is_token_in_rank [T, R], event)``; computed on the current stream."""
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            _fail("allocate_on_comm_stream", "needs previous_event and async_finish=True (as in DeepEP)")
        if previous_event is not None:
            if not isinstance(previous_event, EventOverlap):
                _fail("previous_event", f"expected an EventOverlap, got {type(previous_event).__name__}")
            if previous_event.event is not None:
                previous_event.event.current_stream_wait()
        per_rank, per_expert, in_rank = self._dc.get_dispatch_layout(topk_idx, num_experts)
        per_rdma_rank = None
        if self.num_rdma_ranks > 1:
            per_rdma_rank = _h._node_mask(in_rank, self._gpus_per_node).sum(dim=0, dtype=torch.int32)
        return per_rank, per_rdma_rank, per_expert, in_rank, self._event(async_finish)

    # ---- normal mode ----
    def dispatch(self, x: Payload, handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> \
            Tuple[Payload, Optional[torch.Tensor], Optional[torch.Tensor], List[int], Tuple, EventOverlap]:
        """``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``; with a
        ``handle`` (cached route): ``(recv_x, None, None, None, None, event)``. Several nodes: internode_dispatch."""
        config = self.get_dispatch_config(self.group_size) if config is None else config
        if self.num_rdma_ranks > 1:
            return self.internode_dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                           is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                           expert_alignment, num_worst_tokens, config, previous_event,
                                           async_finish, allocate_on_comm_stream)
        return self._dispatch("intranode", x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                              topk_idx, topk_weights, expert_alignment, num_worst_tokens, config, previous_event,
                              async_finish, allocate_on_comm_stream)

    def combine(self, x: torch.Tensor, handle: Tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Bias = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """``(combined_x, combined_topk_weights, event)``: rows summed back to their source tokens (no weights
        applied), plus ``bias``. Several nodes: internode_combine."""
        config = self.get_combine_config(self.group_size) if config is None else config
        if self.num_rdma_ranks > 1:
            return self.internode_combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                          allocate_on_comm_stream)
        return self._combine("intranode", x, handle, topk_weights, bias, config, previous_event, async_finish,
                             allocate_on_comm_stream)

    def internode_dispatch(self, x: Payload, handle: Optional[Tuple] = None,
                           num_tokens_per_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                           is_token_in_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_expert: Optional[torch.Tensor] = None,
                           topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                           expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                           previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False) -> \
            Tuple[Payload, Optional[torch.Tensor], Optional[torch.Tensor], List[int], Tuple, EventOverlap]:
        """``dispatch`` with DeepEP's internode handle tuple (``dispatch`` calls it on several nodes)."""
        if config is None:
            _fail("config", "required (as in DeepEP; dispatch fills it in)")
        if num_tokens_per_rdma_rank is not None and num_worst_tokens == 0 and handle is None:
            self._check_int_tensor("num_tokens_per_rdma_rank", num_tokens_per_rdma_rank, (self.num_rdma_ranks,))
        return self._dispatch("internode", x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                              topk_idx, topk_weights, expert_alignment, num_worst_tokens, config, previous_event,
                              async_finish, allocate_on_comm_stream)

    def internode_combine(self, x: torch.Tensor, handle: Union[tuple, list],
                          topk_weights: Optional[torch.Tensor] = None, bias: Bias = None,
                          config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                          async_finish: bool = False, allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        if config is None:
            _fail("config", "required (as in DeepEP; combine fills it in)")
        return self._combine("internode", x, handle, topk_weights, bias, config, previous_event, async_finish,
                             allocate_on_comm_stream)

    def _check_int_tensor(self, name: str, t, shape) -> None:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != tuple(shape):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            _fail(name, f"expected an int32 tensor of shape {tuple(shape)}, got {got}")
        if t.device != self._dc.device:
            _fail(name, f"expected a tensor on {self._dc.device}, got one on {t.device}")

    def _fits(self, config, x, num_experts: int, num_topk: int, combine: bool = False) -> None:
        """ValueError naming num_nvl_bytes / num_rdma_bytes when DeepEP's buffers could not carry this call (fit.py);
        a malformed ``x`` is left for deepcomm to name."""
        values = x[0] if isinstance(x, tuple) and len(x) == 2 else x
        if not isinstance(values, torch.Tensor) or values.dim() != 2:
            return
        scales = x[1] if isinstance(x, tuple) and isinstance(x[1], torch.Tensor) and x[1].dim() == 2 else None
        if combine:
            _fit.check_combine(config, self.group_size, values.shape[1], values.element_size(), num_topk,
                               self.num_nvl_bytes, self.num_rdma_bytes)
        else:
            _fit.check_dispatch(config, self.group_size, num_experts, values.shape[1], values.element_size(),
                                num_topk, 0 if scales is None else scales.shape[1], self.num_nvl_bytes,
                                self.num_rdma_bytes)

    @_name_size_keyword
    def _dispatch(self, kind, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                  topk_weights, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
                  allocate_on_comm_stream):
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                _fail("topk_idx" if topk_idx is not None else "topk_weights",
                      "must be None when a handle is given (cached dispatch), as in DeepEP")
            dc = _h.resolve(handle, kind, self._handles)
            owner = self._owner(dc)
            prev = self._before(owner, previous_event, config, async_finish, allocate_on_comm_stream)
            self._fits(config, x, 0, 0)
            x, recv_as_given = _payload.adapt(x)  # FP8 scales of any layout DeepEP takes
            recv_x = owner.dispatch(x, handle=dc, expert_alignment=expert_alignment, previous_event=prev,
                                    async_finish=async_finish)[0]
            event = self._event(async_finish, stream=self._comm_stream_if(owner, async_finish))
            return recv_as_given(recv_x), None, None, None, None, event
        prev = self._before(self._dc, previous_event, config, async_finish, allocate_on_comm_stream)
        for name, value in (("num_tokens_per_rank", num_tokens_per_rank), ("is_token_in_rank", is_token_in_rank),
                            ("num_tokens_per_expert", num_tokens_per_expert)):
            if value is None:
                _fail(name, "required when no handle is given (from get_dispatch_layout), as in DeepEP")
        self._check_int_tensor("num_tokens_per_rank", num_tokens_per_rank, (self.group_size,))
        if not isinstance(num_tokens_per_expert, torch.Tensor) or num_tokens_per_expert.dim() != 1:
            _fail("num_tokens_per_expert", "expected a 1-D int32 tensor [num_experts]")
        num_experts = num_tokens_per_expert.numel()
        num_topk = topk_idx.shape[1] if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2 else 0
        self._fits(config, x, num_experts, num_topk)
        x, recv_as_given = _payload.adapt(x)
        values = x[0] if isinstance(x, tuple) else x
        tokens, hidden = (values.shape[0], values.shape[1]) if isinstance(values, torch.Tensor) \
            and values.dim() == 2 else (0, 0)
        if num_worst_tokens and isinstance(num_worst_tokens, int):
            # graph-capturable form: sized from num_worst_tokens, the same on every rank (sizes.py)
            self._sizes.grow_for(-(-num_worst_tokens // self.group_size), hidden, "num_worst_tokens")
        if topk_idx is not None:
            # The route of topk_idx: the same as is_token_in_rank's when that is get_dispatch_layout's.
            self._check_int_tensor("num_tokens_per_expert", num_tokens_per_expert, (num_experts,))
            route = dict(topk_idx=topk_idx)
        else:
            route = dict(is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert)
        while True:
            dc_buffer = self._dc
            try:
                out = dc_buffer.dispatch(x, topk_weights=topk_weights, num_experts=num_experts,
                                         expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
                                         previous_event=prev, async_finish=async_finish, **route)
            except ValueError:
                # refused on every rank (deepcomm's contract); grown, every rank runs it again (sizes.py)
                if num_worst_tokens or (self._sizes.fixed_tokens and self._sizes.fixed_hidden) \
                        or not self._sizes.regrow_after_refusal(tokens, hidden):
                    raise
                continue
            break
        recv_x, recv_idx, recv_w, counts, dc = out
        counts = [] if num_worst_tokens else [int(c) for c in counts]  # DeepEP: no list in the worst-case form
        stream = self._comm_stream_if(dc_buffer, async_finish)
        with self._derived(stream):
            if kind == "intranode":
                items = _h.intranode(dc, config.num_sms // 2)
            else:
                items = _h.internode(dc, config.num_sms // 2, self.rank, self._gpus_per_node)
        if stream is not None:
            caller = torch.cuda.current_stream(dc_buffer.device)
            for t in items:
                if isinstance(t, torch.Tensor):
                    t.record_stream(caller)
        deep_handle = _h.DeepEPHandle(items, dc)
        self._handles.add(items[_h.KEY_ITEM[kind]], dc)
        return recv_as_given(recv_x), recv_idx, recv_w, counts, deep_handle, self._event(async_finish, stream=stream)

    def _combine(self, kind, x, handle, topk_weights, bias, config, previous_event, async_finish,
                 allocate_on_comm_stream):
        dc = _h.resolve(handle, kind, self._handles)
        owner = self._owner(dc)
        prev = self._before(owner, previous_event, config, async_finish, allocate_on_comm_stream)
        num_topk = topk_weights.shape[1] if isinstance(topk_weights, torch.Tensor) and topk_weights.dim() == 2 else 0
        self._fits(config, x, 0, num_topk, combine=True)
        bias_0, bias_1 = Buffer._unpack_bias(bias)
        with_bias = bias_0 is not None or bias_1 is not None
        combined_x, combined_w = owner.combine(x, dc, topk_weights=topk_weights, previous_event=prev,
                                               async_finish=async_finish and not with_bias)
        if with_bias:
            acc = combined_x.float()
            for name, b in (("bias[0]" if isinstance(bias, tuple) else "bias", bias_0), ("bias[1]", bias_1)):
                if b is None:
                    continue
                if not isinstance(b, torch.Tensor) or tuple(b.shape) != tuple(combined_x.shape) \
                        or b.dtype != combined_x.dtype or b.device != combined_x.device:
                    _fail(name, f"expected a {combined_x.dtype} tensor of shape {tuple(combined_x.shape)} on "
                                f"{combined_x.device}")
                acc = acc + b.float()
            combined_x = acc.to(combined_x.dtype)  # on the current stream, after the combine
            return combined_x, combined_w, self._event(async_finish)
        return combined_x, combined_w, self._event(async_finish, stream=self._comm_stream_if(owner, async_finish))

    # ---- low-latency mode ----
    def _low_latency_shape(self, num_max_dispatch_tokens_per_rank, hidden, num_experts) -> None:
        """What every low-latency call checks: the mode, DeepEP's layout within num_rdma_bytes, and deepcomm's
        hidden (grown if it was not fixed: the same on every rank, sizes.py)."""
        if not self.low_latency_mode:
            _fail("low_latency_mode", "low-latency calls need Buffer(..., low_latency_mode=True), as in DeepEP")
        if isinstance(num_max_dispatch_tokens_per_rank, int) and isinstance(hidden, int) \
                and isinstance(num_experts, int) and min(num_max_dispatch_tokens_per_rank, hidden, num_experts) > 0:
            _fit.check_low_latency(num_max_dispatch_tokens_per_rank, hidden, num_experts, self.num_rdma_bytes)
            self._sizes.grow_for(1, hidden, "x")

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """deepcomm's low-latency buffers need no zeroing between normal and low-latency calls; this checks the
        shape as DeepEP does and zeroes DeepEP's signalling words in get_local_buffer_tensor's RDMA region."""
        for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                            ("hidden", hidden), ("num_experts", num_experts)):
            _check_count(name, value)
        self._low_latency_shape(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        region = self._scratch.get(True)
        if region is not None:  # DeepEP zeroes both signalling buffers: num_experts ints at the start of each
            signaling = _fit.low_latency_layout_bytes(num_max_dispatch_tokens_per_rank, hidden, num_experts)
            for start in (0, signaling["signaling"]):
                region[start:start + num_experts * 4].zero_()

    @_name_size_keyword
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False) -> \
            Tuple[Payload, torch.Tensor, Tuple, EventOverlap, Callable]:
        """``(recv_x, recv_count, handle, event, hook)``; ``recv_x`` is ``(e4m3 [L, R*M, H], scales)`` with
        ``use_fp8`` (scales fp32 ``[L, R*M, H/128]``, or int32 ``[L, R*M, H/512]`` with ``use_ue8m0``; column-major
        in the last two dimensions), else bf16 ``[L, R*M, H]``."""
        if dispatch_wait_recv_cost_stats is not None:
            _fail("dispatch_wait_recv_cost_stats", "deepcomm does not time the waits per source rank; pass None")
        if use_ue8m0 and not round_scale:
            _fail("use_ue8m0", "needs round_scale=True (as in DeepEP)")
        if use_fp8 and use_ue8m0 and x.shape[-1] % 512 != 0:
            _fail("x", f"use_ue8m0 packs 4 scales per int32: hidden must be a multiple of 512, got {x.shape[-1]}")
        L = num_experts // self.group_size if isinstance(num_experts, int) and num_experts > 0 else 0
        stats = cumulative_local_expert_recv_stats
        if stats is not None:
            self._check_int_tensor("cumulative_local_expert_recv_stats", stats, (L,))
        if isinstance(x, torch.Tensor) and x.dim() == 2:
            self._low_latency_shape(num_max_dispatch_tokens_per_rank, x.shape[1], num_experts)
        recv_x, recv_count, dc, hook = self._dc.low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=use_fp8,
            use_ue8m0=bool(use_fp8 and round_scale), return_recv_hook=return_recv_hook)
        if use_fp8:
            values, scales = recv_x
            n, rows, groups = scales.shape
            if use_ue8m0:  # column-major in the last two dims, like DeepEP's TMA-friendly scales
                out_scales = torch.empty(n, groups // 4, rows, dtype=torch.int32, device=scales.device).transpose(1, 2)
            else:
                out_scales = torch.empty(n, groups, rows, dtype=torch.float32, device=scales.device).transpose(1, 2)
            result = (values, out_scales)
        else:
            scales, out_scales, result = None, None, recv_x
        layout_range = torch.empty(dc.layout.shape[:2], dtype=torch.int64, device=dc.layout.device)

        def finish():  # after the data arrived: the layout and the scales are written by then
            _h.layout_range_of(dc, out=layout_range)
            if scales is not None:
                out_scales.copy_(_fp8.pack_ue8m0(scales) if use_ue8m0 else scales)
            if stats is not None:
                stats.add_(recv_count.to(stats.dtype))

        recv_hook = _once(hook, finish)
        if not return_recv_hook:
            recv_hook()
        deep_handle = _h.DeepEPHandle(_h.low_latency(dc, layout_range), dc)
        self._handles.add(layout_range, dc)
        extra = None
        if async_finish:
            parts = result if isinstance(result, tuple) else (result,)
            extra = (x, topk_idx) + tuple(parts) + (recv_count, dc.src_info, layout_range, stats)
        return result, recv_count, deep_handle, self._event(async_finish, extra), \
            (recv_hook if return_recv_hook else None)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None) -> \
            Tuple[torch.Tensor, EventOverlap, Callable]:
        """``(combined_x bf16 [T, H], event, hook)``: each token's expert outputs summed with its weights.
        ``zero_copy``: the expert outputs are read from the tensor ``get_next_low_latency_combine_buffer(handle)``
        returned (written there by the caller), as DeepEP reads its send buffer; ``x`` is not read then."""
        if not isinstance(zero_copy, bool):
            _fail("zero_copy", f"expected a bool, got {type(zero_copy).__name__}")
        if use_logfmt:
            _fail("use_logfmt", "deepcomm has no LogFMT combine (its optional FP8 wire format is "
                                "deepcomm.Buffer.low_latency_combine(use_fp8=True))")
        if combine_wait_recv_cost_stats is not None:
            _fail("combine_wait_recv_cost_stats", "deepcomm does not time the waits per source rank; pass None")
        dc = _h.resolve(handle, "low_latency", self._handles)
        if zero_copy:
            x = self._written_combine_buffer(x, dc)
        combined, hook = self._owner(dc).low_latency_combine(x, topk_idx, topk_weights, dc,
                                                             return_recv_hook=return_recv_hook)
        if out is not None and (not isinstance(out, torch.Tensor) or out.shape != combined.shape
                                or out.dtype != combined.dtype or out.device != combined.device):
            _fail("out", f"expected a {combined.dtype} tensor of shape {tuple(combined.shape)} on {combined.device}")
        result = combined if out is None else out
        recv_hook = _once(hook, (lambda: out.copy_(combined)) if out is not None else None)
        if not return_recv_hook:
            recv_hook()
        extra = (x, topk_idx, topk_weights, dc.src_info, result) if async_finish else None
        return result, self._event(async_finish, extra), (recv_hook if return_recv_hook else None)

    def _combine_buffer_shape(self, dc) -> tuple:
        return (dc.num_experts // self.group_size, self.group_size * dc.num_max_dispatch_tokens_per_rank, dc.hidden)

    def _combine_buffer(self, shape: tuple) -> torch.Tensor:
        """The bf16 tensor of get_next_low_latency_combine_buffer for ``shape`` (one per shape, reused)."""
        if shape not in self._combine_buffers:
            self._combine_buffers[shape] = torch.empty(shape, dtype=torch.bfloat16, device=self._dc.device)
        return self._combine_buffers[shape]

    def _written_combine_buffer(self, x, dc) -> torch.Tensor:
        """The combine buffer of ``dc``'s shape, for a zero-copy combine (``x`` is checked for its shape only)."""
        shape = self._combine_buffer_shape(dc)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            _fail("x", f"expected shape {shape} (the handle's [local experts, ranks * M, hidden]), got {got}")
        buffer = self._combine_buffers.get(shape)
        if buffer is None:
            _fail("zero_copy", "the expert outputs are read from get_next_low_latency_combine_buffer(handle), "
                               "which was not called on this Buffer: call it and write them there first")
        return buffer

    def get_next_low_latency_combine_buffer(self, handle: object):
        """A bf16 ``[L, R*M, H]`` tensor to write expert outputs into; ``low_latency_combine(..., zero_copy=True)``
        then reads them from it (one per shape, reused by later calls; passing it as ``x`` works too)."""
        return self._combine_buffer(self._combine_buffer_shape(_h.resolve(handle, "low_latency", self._handles)))

    # ---- shrink mode: deepcomm's Buffer.mask_ranks / unmask_ranks ----
    def _check_shrink(self) -> None:
        if not self.enable_shrink:
            _fail("enable_shrink", "the mask buffer needs Buffer(..., enable_shrink=True), as in DeepEP")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False):
        """``mask=True``: this rank stops sending to and waiting for ``rank_to_mask`` (``Buffer.mask_ranks``).
        ``mask=False`` on a masked rank: refused (deepcomm unmasks all ranks at once, collectively:
        ``low_latency_clean_mask_buffer``); on an unmasked one there is nothing to do."""
        self._check_shrink()
        if isinstance(rank_to_mask, bool) or not isinstance(rank_to_mask, int) \
                or not 0 <= rank_to_mask < self.group_size:
            _fail("rank_to_mask", f"expected a rank in [0, {self.group_size}), got {rank_to_mask!r}")
        if rank_to_mask == self.rank:
            _fail("rank_to_mask", f"cannot mask this rank ({self.rank}) itself")
        if mask:
            for dc in self._sizes.all():
                dc.mask_ranks([rank_to_mask])
        elif rank_to_mask in self._dc.masked_ranks:
            _fail("mask", "deepcomm cannot unmask one rank; low_latency_clean_mask_buffer() unmasks every rank "
                          "(collective)")

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor):
        """Writes 1 for masked ranks and 0 for the others into ``mask_status`` (int32 ``[num_ranks]``)."""
        self._check_shrink()
        self._check_int_tensor("mask_status", mask_status, (self.group_size,))
        status = torch.zeros(self.group_size, dtype=torch.int32)
        status[self._dc.masked_ranks] = 1
        mask_status.copy_(status)

    def low_latency_clean_mask_buffer(self):
        """Unmask every rank (``Buffer.unmask_ranks``): collective, every rank of the group calls it."""
        self._check_shrink()
        for dc in self._sizes.all():
            dc.unmask_ranks()

    def __repr__(self) -> str:
        return f"deep_ep.Buffer(compat over {self._dc!r})"


def _deep_ep_backend(backend: str) -> str:
    """DeepEP runs on the current CUDA device whatever the group's backend (it only bootstraps over the group:
    inference engines hand it their gloo group). deepcomm's "auto" keeps a gloo group's Buffer on the CPU, so
    "auto" here means the CUDA backend wherever it can run; the reference backend where it cannot."""
    if backend == "auto" and cuda_unavailable_reason(None, "cuda") is None:
        return "cuda"
    return backend


def _once(hook: Callable[[], None], then: Optional[Callable[[], None]]) -> Callable[[], None]:
    """``hook`` then ``then``, the first time only (DeepEP's hooks may be called again)."""
    done = []

    def recv_hook() -> None:
        if not done:
            hook()
            if then is not None:
                then()
            done.append(True)
    return recv_hook
