"""Buffer: the user-facing object. Validates every input, then delegates to a backend."""
from __future__ import annotations

import functools
import inspect
import itertools
import os
import sys
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import agreement, buffer_registry, route_only
from . import validation as v
from .backends import group_device, make_backend
from .buffer_report import log_buffer_created
from .call_check import CallChecker, resolve_check_calls
from .config import DEFAULT_HIDDEN, DEFAULT_TIMEOUT_S, Config, default_num_sms
from .errors import CommTimeoutError
from .failure_board import TIMEOUT_GRACE_S, FailureBoard
from .gpu_share import GPU_SMS_ENV, usable_sms
from .handle import Handle, LowLatencyHandle
from .rendezvous import default_store, wait_for_group
from .topology import resolve_topology

_buffer_ids = itertools.count(1)


def _collective(op: str):
    """A collective call of a Buffer: numbered (``Buffer._calls``, the same on every rank) and compared across ranks
    right before the backend runs (``Buffer._agree``: its fingerprint, deepcomm/agreement.py, goes to the backend,
    which compares it in the call's first exchange; with check_calls on, deepcomm/call_check.py, the store compares
    its signature first). An error of this rank's own before that point is made known instead (``Buffer._reject``),
    so the other ranks raise too instead of pairing this call's exchange with this rank's next call."""
    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            if op not in self._capturable and self._device.type == "cuda" and v.is_capturing():
                # before the call is numbered, and joining no exchange: every rank of the capture raises alike
                where = self._backend_name + (", internode" if self.topology.is_internode else "")
                raise RuntimeError(f"deepcomm: {op} cannot be captured in a CUDA graph on this Buffer's backend "
                                   f"({where}: it waits on the host, or copies host tables per call); it captures "
                                   f"{', '.join(sorted(self._capturable)) or 'no call'}. Make this call outside "
                                   "the capture")
            self._calls += 1
            self._pending_op = op
            self._joined_at = -1
            try:
                return method(self, *args, **kwargs)
            except Exception as e:
                if self._pending_op is not None:
                    self._pending_op = None
                    self._reject(op, e, _handle_argument(method, self, args, kwargs))
                elif self._never_joined(e):  # the store (check_calls) agreed already: the peers are in the backend
                    self._reject_in_backend(op, e, _handle_argument(method, self, args, kwargs))
                self._raise_told(e)
                raise
            finally:
                self._pending_op = None
        return call
    return wrap


def _handle_argument(method, self, args, kwargs):
    """The ``handle`` a call of ``method`` was given (None if none, or if the arguments do not bind)."""
    try:
        return inspect.signature(method).bind_partial(self, *args, **kwargs).arguments.get("handle")
    except TypeError:
        return None


class Buffer:
    """Expert-parallel communication over one process group (see docs/api.md)."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, max_tokens_per_rank: int = 4096, hidden: Optional[int] = None,
                 num_sms: Optional[int] = None, backend: str = "auto", num_max_low_latency_tokens: int = 128,
                 timeout_s: Optional[float] = None, gpus_per_node: Optional[int] = None,
                 low_latency_memory: Optional[str] = None, internode_transport: Optional[str] = None,
                 check_calls: Optional[bool] = None):
        self._backend = None
        self._failures = None
        self._call_checker = None
        self._pending_op = None
        self._calls = 0  # collective calls made on this Buffer (agreement.Word.CALL)
        self._takes_fingerprints = False
        self._capturable = frozenset()  # the calls the backend runs inside CUDA graph capture (Capabilities)
        self._arg_reader = None  # the backend's argument reader, where plain calls take it (reads_plain_calls)
        self._counts_joined = False  # the backend counts the calls that entered their first exchange
        self._joined_at = -1  # its count when the current call's backend part began (-1: not counted)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("deepcomm.Buffer: torch.distributed is not initialized "
                               "(call torch.distributed.init_process_group first)")
        self._group = dist.group.WORLD if group is None else group
        self._rank = dist.get_rank(self._group)
        self._world_size = dist.get_world_size(self._group)
        self.topology = resolve_topology(self._world_size, gpus_per_node)  # ValueError naming the bad source
        if backend not in ("auto", "cuda", "reference"):
            v.fail("backend", f"expected 'auto', 'cuda' or 'reference', got {backend!r}")
        self._device = group_device(self._group, backend)
        if num_sms is None:
            num_sms = default_num_sms(usable_sms(self._device) if self._device.type == "cuda" else None)
        self.config = Config(num_sms=num_sms,
                             timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s,
                             max_tokens_per_rank=max_tokens_per_rank,
                             hidden=DEFAULT_HIDDEN if hidden is None else hidden,
                             num_max_low_latency_tokens=num_max_low_latency_tokens,
                             gpus_per_node=self.topology.gpus_per_node,
                             low_latency_memory=low_latency_memory,
                             internode_transport=internode_transport)
        self.buffer_id = next(_buffer_ids)
        check_calls = resolve_check_calls(check_calls)
        # every rank is here before the first collective, or a CommTimeoutError names who is not (bounded); and the
        # settings that lay out the shared buffers or pair blocks across ranks agree (ValueError naming one if not)
        number = wait_for_group(self._group, self._rank, self.config.timeout_s, settings={
            # "auto" and "cuda" may meet (auto picks cuda where it can); "reference" must meet itself
            "backend": "reference" if backend == "reference" else "cuda or auto",
            "DEEPCOMM_LL_NUM_SMS": os.environ.get("DEEPCOMM_LL_NUM_SMS"),  # low-latency blocks pair up across ranks
            GPU_SMS_ENV: os.environ.get(GPU_SMS_ENV),  # so does their default count, sized from this share
            "DEEPCOMM_LL_FORCE_PUTS": os.environ.get("DEEPCOMM_LL_FORCE_PUTS", "").strip() not in ("", "0"),
            # the internode kernels and the torch routing make different exchanges (internode/backend.py)
            "DEEPCOMM_INTERNODE_KERNELS": os.environ.get("DEEPCOMM_INTERNODE_KERNELS", "1") != "0",
            "max_tokens_per_rank": self.config.max_tokens_per_rank,
            "hidden": self.config.hidden, "num_sms": self.config.num_sms,
            "num_max_low_latency_tokens": self.config.num_max_low_latency_tokens,
            "low_latency_memory": self.config.low_latency_memory,
            "internode_transport": self.config.internode_transport,
            "gpus_per_node": self.config.gpus_per_node, "check_calls": check_calls})
        if check_calls and number is not None:
            self._call_checker = CallChecker(default_store(), self._group, self._rank, self._world_size,
                                             self.config.timeout_s, f"b{number}")
        self._buffer_word = 0 if number is None else number + 1  # agreement.Word.BUFFER
        # where a call that broke this rank's Buffer says why, and the peers' timeouts read it
        self._failures = (None if number is None else
                          FailureBoard(default_store(), dist.get_process_group_ranks(self._group), number, self._rank))
        self._backend, choice = make_backend(backend, self._group, self.config, self._rank, self._world_size,
                                             self._device, number)
        self._backend_name = choice.name
        log_buffer_created(self, choice)
        caps = self._backend.capabilities  # deepcomm/backend_protocol.py
        # the backend compares fingerprints in each call's first exchange and has reject() (deepcomm/agreement.py)
        self._takes_fingerprints = caps.takes_fingerprints
        self._capturable = caps.capturable
        # an error inside the backend before the call's first exchange is rejected as an argument error is
        self._counts_joined = caps.takes_fingerprints and caps.counts_joined_calls
        # dtypes of a non-FP8 x the backend takes in normal mode (the CUDA backend: bf16 only)
        self._x_dtypes = caps.x_dtypes
        # plain calls checked, fingerprinted and read in one crossing (Capabilities.reads_plain_calls); with
        # check_calls on, the store compares each call's signature first: the Python path does that
        if caps.reads_plain_calls and caps.takes_fingerprints and self._call_checker is None:
            self._arg_reader = self._backend.arg_reader
            self._arg_reader.set_num_sms(self.config.num_sms)  # the fingerprint's NUM_SMS word
        buffer_registry.register(self)  # for the custom ops of torch.compile (deepcomm/custom_ops.py)

    # ---- properties -------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def group(self) -> dist.ProcessGroup:
        return self._group

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def backend_name(self) -> str:
        return self._backend_name

    @property
    def num_sms(self) -> int:
        return self.config.num_sms

    def set_num_sms(self, num_sms: int) -> None:
        v.check_int("num_sms", num_sms, minimum=1)
        self._live().set_num_sms(num_sms)
        self.config.num_sms = num_sms
        if self._arg_reader is not None:
            self._arg_reader.set_num_sms(num_sms)

    def size_bytes(self) -> int:
        """Bytes of communication buffers the backend holds (0 for the reference backend)."""
        return self._live().size_bytes()

    def low_latency_buffer_info(self) -> Dict[str, object]:
        """``{"memory": "ipc" | "nvshmem", "bytes": n}``: where the CUDA backend's low-latency buffer lives and its
        size (0 before the first low-latency call); ``memory`` is None on the reference backend, which has none."""
        return self._live().low_latency_buffer_info()

    # ---- normal mode ------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor,
                            num_experts: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R])``."""
        backend = self._live()
        if topk_idx is None:
            v.fail("topk_idx", "required")
        v.check_num_experts(num_experts, self._world_size)
        v.check_topk_idx(topk_idx, None, num_experts, self._device,
                         check_values=not backend.capabilities.checks_layout_ids_on_device)
        return backend.get_dispatch_layout(topk_idx, num_experts)

    @_collective("dispatch")
    def dispatch(self, x, topk_idx=None, topk_weights=None, num_experts=None, handle=None, expert_alignment=1,
                 num_worst_tokens=0, previous_event=None, async_finish=False, is_token_in_rank=None,
                 num_tokens_per_expert=None):
        """``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert, handle)``.

        ``num_worst_tokens > 0``: no host sync (CUDA-graph capturable); outputs have that many rows, of which
        the first ``sum(handle.count_matrix[:, rank])`` are defined, and ``num_recv_tokens_per_expert`` is an
        int32 tensor. ``previous_event``: start after this event instead of the current stream.
        ``async_finish``: do not make the current stream wait; wait on ``buffer.event`` before using the results.
        ``is_token_in_rank`` (bool ``[T, R]``, no handle): route-only dispatch, rows go where the mask says and
        ``topk_idx`` / ``topk_weights`` travel if given; ``num_tokens_per_expert`` (int32 ``[E]``) gives the
        per-expert counts DeepEP's way (deepcomm/route_only.py).
        """
        backend, reader = self._live(), self._arg_reader
        if (reader is not None and is_token_in_rank is None and num_tokens_per_expert is None
                and previous_event is None and async_finish is False and type(num_worst_tokens) is int
                and not num_worst_tokens and type(expert_alignment) is int and expert_alignment >= 1):
            # a plain call: checked, fingerprinted and read in C++ (deepcomm/cuda/arg_reader.py); None where
            # anything is not what the checks below accept, which then name it
            if handle is None:
                read = reader.fresh(x, topk_idx, topk_weights, num_experts, self._calls, self._buffer_word)
            elif (topk_idx is None and type(handle) is Handle and handle.buffer_id == self.buffer_id
                  and (num_experts is None or type(num_experts) is int and num_experts == handle.num_experts)):
                read = reader.cached(x, topk_weights, handle.num_tokens, handle.num_experts, handle.call, self._calls,
                                     self._buffer_word)
            else:
                read = None
            if read is not None:
                self._backend_owns_call()
                out = backend.dispatch_read(read, num_experts, expert_alignment, handle)
                if handle is None:
                    out[-1].buffer_id, out[-1].call = self.buffer_id, self._calls
                return out
        if type(expert_alignment) is not int or expert_alignment < 1:  # the common values cost no call
            v.check_int("expert_alignment", expert_alignment, minimum=1)
        if type(num_worst_tokens) is not int or num_worst_tokens != 0:
            v.check_int("num_worst_tokens", num_worst_tokens, minimum=0,
                        maximum=self._world_size * self.config.max_tokens_per_rank)
        if previous_event is not None or async_finish is not False:
            self._check_stream_args(previous_event, async_finish)
        if num_worst_tokens == 0 and handle is None and self._device.type == "cuda" and v.is_capturing():
            v.fail("num_worst_tokens", "a fresh dispatch inside CUDA graph capture needs num_worst_tokens > 0 "
                   "(the output size cannot be read back while capturing)")
        num_tokens, _, _ = v.check_dispatch_x(x, self._device, self._x_dtypes, self.config.hidden,
                                              self.config.max_tokens_per_rank)
        if handle is None and is_token_in_rank is not None:  # ---- route-only (deepcomm/route_only.py) ----
            num_experts = route_only.check_inputs(self, num_tokens, is_token_in_rank, topk_idx, topk_weights,
                                                  num_experts, num_tokens_per_expert, num_worst_tokens)
            agreed = self._agree(
                lambda: dict(self._dispatch_fields(x, topk_idx, topk_weights, num_experts, None), route_only=True,
                             expert_counts=num_tokens_per_expert is not None),
                lambda: agreement.dispatch(self._calls, self._buffer_word, x, topk_idx, topk_weights, num_experts,
                                           None, self.config.num_sms))
            out = route_only.dispatch(self, backend, x, is_token_in_rank, topk_idx, topk_weights, num_experts,
                                      num_tokens_per_expert, expert_alignment, previous_event, async_finish, agreed)
            out[-1].buffer_id = self.buffer_id
            return out
        if is_token_in_rank is not None or num_tokens_per_expert is not None:
            v.fail("is_token_in_rank" if is_token_in_rank is not None else "num_tokens_per_expert",
                   "only for a route-only dispatch (is_token_in_rank without a handle)")
        if handle is not None:
            if type(handle) is not Handle or handle.buffer_id != self.buffer_id:
                v.check_handle(handle, Handle, self.buffer_id)
            if num_tokens != handle.num_tokens:
                v.fail("x", f"expected {handle.num_tokens} rows (handle.num_tokens), got {num_tokens}")
            if num_experts is not None and num_experts != handle.num_experts:
                v.fail("num_experts", f"{num_experts} does not match the handle's {handle.num_experts}")
            if topk_idx is not None:  # not needed with a handle; checked so that a wrong one is not silent
                v.check_topk_idx(topk_idx, num_tokens, handle.num_experts, self._device)
            if topk_weights is not None:
                shape = tuple(topk_idx.shape) if topk_idx is not None else (num_tokens, None)
                v.check_topk_weights(topk_weights, shape, self._device)
            agreed = self._agree(lambda: self._dispatch_fields(x, topk_idx, topk_weights, handle.num_experts, handle),
                                 lambda: agreement.dispatch(self._calls, self._buffer_word, x, topk_idx,
                                                            topk_weights, None, handle, self.config.num_sms))
            return backend.dispatch(x, None, topk_weights, handle.num_experts, handle, expert_alignment,
                                    num_worst_tokens, previous_event, async_finish, **agreed)
        ids_on_device = backend.capabilities.checks_expert_ids_on_device
        if not (ids_on_device and v.routing_accepted(topk_idx, topk_weights, num_tokens, num_experts,
                                                     self._world_size, self._device)):
            if topk_idx is None:
                v.fail("topk_idx", "required when no handle is given")
            v.check_num_experts(num_experts, self._world_size)
            v.check_topk_idx(topk_idx, num_tokens, num_experts, self._device, check_values=not ids_on_device)
            if topk_weights is not None:
                v.check_topk_weights(topk_weights, tuple(topk_idx.shape), self._device)
        agreed = self._agree(lambda: self._dispatch_fields(x, topk_idx, topk_weights, num_experts, None),
                             lambda: agreement.dispatch(self._calls, self._buffer_word, x, topk_idx, topk_weights,
                                                        num_experts, None, self.config.num_sms))
        out = backend.dispatch(x, topk_idx, topk_weights, num_experts, None, expert_alignment, num_worst_tokens,
                               previous_event, async_finish, **agreed)
        out[-1].buffer_id, out[-1].call = self.buffer_id, self._calls
        return out

    @_collective("combine")
    def combine(self, x, handle, topk_weights=None, previous_event=None, async_finish=False, use_fp8=False):
        """``(combined_x, combined_topk_weights)``: the reverse route of ``handle``, copies summed.
        ``previous_event`` / ``async_finish`` as in ``dispatch``. ``use_fp8``: rows that cross to another rank
        travel as e4m3 with one fp32 scale per 128 values (bf16 ``x``, ``H % 128 == 0``; same value on every
        rank); lossy, see docs/api.md."""
        backend, reader = self._live(), self._arg_reader
        if (reader is not None and previous_event is None and async_finish is False
                and type(handle) is Handle and handle.buffer_id == self.buffer_id):
            # a plain combine: checked, fingerprinted and read in C++ (deepcomm/cuda/arg_reader.py), or None
            read = reader.combine(x, topk_weights, handle.num_recv, use_fp8, handle.call, self._calls,
                                  self._buffer_word)
            if read is not None:
                self._backend_owns_call()
                return backend.combine_read(read, handle)
        if type(handle) is not Handle or handle.buffer_id != self.buffer_id:
            v.check_handle(handle, Handle, self.buffer_id)
        v.check_combine_x(x, handle, self._device, self._x_dtypes, self.config.hidden, use_fp8)
        if topk_weights is not None:
            v.check_topk_weights(topk_weights, (handle.num_recv, None), self._device)
        if previous_event is not None or async_finish is not False:
            self._check_stream_args(previous_event, async_finish)
        agreed = self._agree(lambda: {"hidden": x.shape[1], "dtype": str(x.dtype),
                                      "topk_weights": topk_weights is not None, "use_fp8": use_fp8,
                                      "num_sms": self.config.num_sms},
                             lambda: agreement.combine(self._calls, self._buffer_word, x, handle, topk_weights,
                                                       use_fp8, self.config.num_sms))
        return backend.combine(x, handle, topk_weights, previous_event=previous_event, async_finish=async_finish,
                               use_fp8=use_fp8, **agreed)

    @property
    def event(self):
        """``torch.cuda.Event`` recorded at the end of the last dispatch/combine on the CUDA backend (``None``
        on the reference backend, whose calls finish before they return)."""
        return self._live().event

    def _agree(self, fields, fingerprint) -> dict:
        """From here on the backend owns the call (its errors are every rank's). With check_calls on: this call's
        signature against every rank's (deepcomm/call_check.py). Returns the backend call's keyword arguments:
        ``fingerprint=fingerprint()``, the call's words (deepcomm/agreement.py), for a backend that takes them."""
        words = fingerprint() if self._takes_fingerprints else None
        op, self._pending_op = self._pending_op, None
        if self._call_checker is not None:  # the fields cost host time: built only when compared
            self._call_checker.agree(op, fields() if callable(fields) else fields)
        if self._counts_joined:
            self._joined_at = self._backend.joined_calls
        return {} if words is None else {"fingerprint": words}

    def _backend_owns_call(self) -> None:
        """A call whose checks passed in the backend's argument reader: from here on the backend owns it, as after
        _agree (its errors are every rank's; the count of joined calls is noted for _never_joined)."""
        self._pending_op = None
        if self._counts_joined:
            self._joined_at = self._backend.joined_calls

    def _never_joined(self, error: Exception) -> bool:
        """Whether the call that raised ``error`` inside the backend (after _agree) never entered its first
        exchange (Capabilities.counts_joined_calls): then the other ranks are in it, or soon will be, and must be
        told, as for a rejected argument. A timeout has no exchange left to join."""
        return (self._joined_at >= 0 and not isinstance(error, CommTimeoutError) and self._backend is not None
                and self._backend.joined_calls == self._joined_at)

    def _tell_failure(self, error: Exception) -> Optional[CommTimeoutError]:
        """After a call raised ``error``: where it broke this rank's Buffer inside its crossing (the peers then wait
        for what this rank never sent), say why on the failure board; where it is a timeout, the same timeout with
        what the peers said there (deepcomm/failure_board.py), to raise instead. None: raise ``error`` as it is."""
        if self._backend is None or self._failures is None:
            return None
        board = self._failures
        if isinstance(error, CommTimeoutError):
            board.post(str(error))  # this rank's Buffer is broken too: say where it gave up
            return board.explain(error, min(TIMEOUT_GRACE_S, 0.5 * self.config.timeout_s))
        reason = self._backend.broken_reason
        if reason is not None:
            board.post(reason)
        return None

    def _raise_told(self, error: Exception) -> None:
        """Inside the handler of ``error``: raise what _tell_failure makes of it, if anything (the caller re-raises
        ``error`` otherwise)."""
        told = self._tell_failure(error)
        if told is not None:
            raise told from error

    def _telling(self, fn, *args):
        """``fn(*args)``, its error passed through _tell_failure (a timeout then names what the peers posted)."""
        try:
            return fn(*args)
        except Exception as e:
            self._raise_told(e)
            raise

    def _telling_hook(self, hook, returned: bool):
        """A low-latency call's receive hook as the caller gets it: where one was asked for (``returned``), called
        through _telling, so a failure inside it is posted and a timeout it raises names what the peers posted."""
        return functools.partial(self._telling, hook) if returned and hook is not None else hook

    def _reject(self, op: str, error: Exception, handle=None) -> None:
        """This rank's call ``op`` raised ``error`` before its exchange: tell the other ranks, which are in that
        exchange (or soon will be), so they raise naming this rank; the caller then raises ``error``. ``handle``:
        the call's handle argument, which picks the exchange a low-latency combine joins (its slot)."""
        if self._call_checker is not None:
            self._call_checker.agree(op, {}, error=str(error))
        elif self._takes_fingerprints and self._backend is not None:
            self._reject_in_backend(op, error, handle)

    def _reject_in_backend(self, op: str, error: Exception, handle=None) -> None:
        """Join call ``op``'s first exchange in the backend as a rejected call (the peers raise naming this rank)."""
        self._backend.reject(agreement.rejected(op, self._calls, self._buffer_word, error), handle=handle)

    def _dispatch_fields(self, x, topk_idx, topk_weights, num_experts, handle) -> dict:
        """What must agree across ranks for one normal dispatch: everything that shapes its rows and its route
        (the token count may differ)."""
        values, scales = (x[0], x[1]) if isinstance(x, (tuple, list)) else (x, None)
        k = topk_idx.shape[1] if topk_idx is not None else (topk_weights.shape[1] if topk_weights is not None else 0)
        return {"hidden": values.shape[1], "dtype": str(values.dtype),
                "scales": None if scales is None else [scales.shape[1], str(scales.dtype)],
                "topk": k if handle is None or topk_weights is not None else None,
                "topk_weights": topk_weights is not None, "num_experts": num_experts,
                "cached_handle": handle is not None, "num_sms": self.config.num_sms}

    @staticmethod
    def _check_stream_args(previous_event, async_finish) -> None:
        if previous_event is not None and not isinstance(previous_event, torch.cuda.Event):
            v.fail("previous_event", f"expected a torch.cuda.Event, got {type(previous_event).__name__}")
        if not isinstance(async_finish, bool):
            v.fail("async_finish", f"expected a bool, got {type(async_finish).__name__}")

    # ---- low-latency mode -------------------------------------------------------------------------------
    @_collective("low_latency_dispatch")
    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True,
                             use_ue8m0=False, return_recv_hook=False):
        """``(recv_x, recv_count, handle, hook)``."""
        backend = self._live()
        limit = backend.capabilities.max_low_latency_ranks
        if limit and self._world_size > limit:
            v.fail("group", f"low-latency mode on the {self.backend_name} backend serves at most {limit} ranks, "
                            f"this group has {self._world_size} (normal mode serves it)")
        v.check_low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                                     use_ue8m0, self._world_size, self._device, self.config.hidden,
                                     self.config.num_max_low_latency_tokens,
                                     check_values=not backend.capabilities.checks_low_latency_ids_on_device)
        self._check_hook_flag(return_recv_hook)
        agreed = self._agree({"hidden": x.shape[1], "topk": topk_idx.shape[1], "num_experts": num_experts,
                              "num_max_dispatch_tokens_per_rank": num_max_dispatch_tokens_per_rank, "use_fp8": use_fp8},
                             lambda: agreement.low_latency_dispatch(self._calls, self._buffer_word, x, topk_idx,
                                                                    num_max_dispatch_tokens_per_rank, num_experts,
                                                                    use_fp8, use_ue8m0))
        recv_x, recv_count, handle, hook = backend.low_latency_dispatch(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, use_ue8m0, return_recv_hook,
            **agreed)
        handle.buffer_id, handle.call = self.buffer_id, self._calls
        return recv_x, recv_count, handle, self._telling_hook(hook, return_recv_hook)

    @_collective("low_latency_combine")
    def low_latency_combine(self, x, topk_idx, topk_weights, handle, return_recv_hook=False, use_fp8=False):
        """``(combined_x, hook)``: bf16 ``[T, H]``, the weighted sum of each token's expert outputs.
        ``use_fp8``: the partial sums that cross to another rank travel as e4m3 + fp32 scales (off by default)."""
        backend = self._live()
        v.check_handle(handle, LowLatencyHandle, self.buffer_id)
        v.check_low_latency_combine(x, topk_idx, topk_weights, handle, self._world_size, self._device,
                                    self.config.hidden)
        self._check_hook_flag(return_recv_hook)
        if not isinstance(use_fp8, bool):
            v.fail("use_fp8", f"expected a bool, got {type(use_fp8).__name__}")
        agreed = self._agree({"hidden": x.shape[2], "topk": topk_idx.shape[1], "use_fp8": use_fp8},
                             lambda: agreement.low_latency_combine(self._calls, self._buffer_word, x, topk_idx, handle,
                                                                   use_fp8))
        combined, hook = backend.low_latency_combine(x, topk_idx, topk_weights, handle, return_recv_hook,
                                                     use_fp8=use_fp8, **agreed)
        return combined, self._telling_hook(hook, return_recv_hook)

    # ---- masking lost ranks (low-latency mode) ----------------------------------------------------------
    def mask_ranks(self, ranks: Iterable[int]) -> None:
        """Go on in low-latency mode without ``ranks`` (e.g. the peer a ``CommTimeoutError`` named, after its
        process died): from the next call on nothing is sent to them or awaited from them, and slots naming their
        experts count as -1 (dropped from dispatch, absent from combine). Local, no collective: each survivor calls
        it, with the same ranks. A timeout waiting for a masked peer is cleared, and the Buffer works again in
        low-latency mode for shapes it has already run; normal mode refuses to run while ranks are masked."""
        backend = self._live()
        if isinstance(ranks, int) or not hasattr(ranks, "__iter__"):
            v.fail("ranks", f"expected an iterable of ranks, got {type(ranks).__name__}")
        ranks = list(ranks)
        for r in ranks:
            v.check_int("ranks", r, minimum=0, maximum=self._world_size - 1)
            if r == self._rank:
                v.fail("ranks", f"cannot mask this rank ({r}) itself")
        backend.mask_ranks(frozenset(ranks))

    def unmask_ranks(self) -> None:
        """Every rank takes part again. Collective: every rank of the group calls it, with no low-latency call in
        flight (masked ranks missed calls, so the kernels' call numbers restart everywhere)."""
        self._live().unmask_ranks()

    @property
    def masked_ranks(self) -> List[int]:
        return sorted(self._live().masked)

    # ---- lifetime ---------------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until this Buffer's outstanding device work is done."""
        self._telling(self._live().synchronize)

    def destroy(self) -> None:
        """Release the backend's resources. Idempotent; the Buffer is unusable afterwards."""
        backend, self._backend = self._backend, None
        if backend is not None:
            backend.destroy()

    def __del__(self):
        # At interpreter shutdown the modules a backend needs may already be gone: leave cleanup to the OS.
        if sys is None or sys.is_finalizing():
            return
        try:
            self.destroy()
        except Exception:
            pass

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = "destroyed" if self._backend is None else self._backend_name
        return (f"deepcomm.Buffer(id={self.buffer_id}, rank={self._rank}/{self._world_size}, backend={state}, "
                f"device={self._device}, num_sms={self.config.num_sms})")

    def _live(self):
        if self._backend is None:
            raise RuntimeError("deepcomm.Buffer: used after destroy()")
        return self._backend

    @staticmethod
    def _check_hook_flag(return_recv_hook) -> None:
        if not isinstance(return_recv_hook, bool):
            v.fail("return_recv_hook", f"expected a bool, got {type(return_recv_hook).__name__}")
