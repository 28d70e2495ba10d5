"""CudaBackend: normal-mode layout, dispatch and combine on the NVLink kernels of ``deepcomm._C``.

Same method signatures and results as ``deepcomm.reference.ReferenceBackend``; the Buffer validates inputs
before calling in. A plain call runs on the caller's stream; one with ``previous_event`` or ``async_finish`` runs
on a communication stream that first waits for the caller's stream (or for ``previous_event``), and unless
``async_finish`` the caller's stream then waits for it; either way results are ready in stream order, and
``self.event`` marks the end of the last call (_order). Each call crosses into C++ once (csrc/runtime/nvl_calls.hpp: stream order, launches, and a fresh dispatch's wait for its
counts in mapped host memory); a fresh dispatch's payload is launched before that wait, into an output block
reserved for the worst case whose unused tail goes back to the arena.
Low-latency mode (deepcomm/cuda/ll_calls.py) uses its own double-buffered buffer and runs on the caller's stream.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from .. import agreement
from .._ext import load_extension
from ..validation import is_capturing
from ..config import resolve_arena_full
from ..errors import CommTimeoutError
from ..gpu_share import GPU_SMS_ENV, shares_gpu, usable_sms
from ..backend_protocol import Capabilities
from ..handle import Handle, WorkspaceViews, field_ptr
from ..log import logger
from ..cuda.agree_record import dispatch_disagreement, words_or_none
from ..cuda.arg_reader import dispatch_arg_reader
from ..cuda.arena import Arena
from ..cuda.call_errors import CallErrors
from ..cuda.ll_calls import LowLatencyEngine, low_latency_blocks
from ..cuda.mode_meet import ModeMeet
from ..cuda.work_pool import WorkPool
from .arena_sizing import arena_sizes
from .dispatch_call import DispatchCall, OutputTypes, Received, carve
from .nvl_buffer import NvlBuffer

Payload = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def _share_note() -> str:
    return f" by {GPU_SMS_ENV}" if shares_gpu() else ""


# NvlContext.dispatch_call's steps and stream-order bits (csrc/bindings/args.hpp, exported as DISPATCH_FLAGS)
BEGIN = NOTIFY = BUMP = PAYLOAD = WAIT = FINISH = WAIT_CALLER = CALLER_WAITS = REPORT_INVALID = 0


def _load_flags(C) -> None:
    g = globals()
    for name, bit in C.DISPATCH_FLAGS.items():
        g[name.upper()] = bit


# FreshDispatchWork's offsets in the order _work_layout returns them (csrc/runtime/nvl_layout.hpp)
WORK_PARTS = ("send_pos", "notify_out", "count_matrix", "per_expert", "bad_all", "src_idx", "in_rank", "total")

# where a dispatch's rows land: "arena", an arena block reserved before the counts are known (worst-case size,
# trimmed after the wait); "exact", an arena block of the size the counts gave (the worst case did not fit);
# "bounce", the bounce area, copied out (no block fitted)
PLACEMENTS = ("arena", "exact", "bounce")

EVENT_RING = 8            # end-of-call events a Buffer cycles through (Buffer.event is the newest)
LAYOUT_CACHE = 256        # layouts a backend keeps per kind (shapes seen), so the extension is asked once per shape


def _remember(cache: dict, key, value):
    """``value``, kept in ``cache`` under ``key`` while the cache holds fewer than LAYOUT_CACHE entries."""
    if len(cache) < LAYOUT_CACHE:
        cache[key] = value
    return value


def _current_stream(device_index: int) -> int:
    """The caller's current CUDA stream as a raw pointer (a torch Stream object costs microseconds to make)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def _torch_stream(raw: int, device: torch.device) -> torch.cuda.Stream:
    """The torch stream of a raw CUDA stream. 0 is the legacy default stream, which is torch's default stream:
    ``torch.cuda.ExternalStream(0)`` would hand out a fresh pool stream instead (non-blocking: ordered with nothing
    on the default stream)."""
    if raw == 0:
        return torch.cuda.default_stream(device)
    return torch.cuda.ExternalStream(raw, device=device)


def _event_handle(event: torch.cuda.Event) -> int:
    """The cudaEvent_t of a torch event (0 for one never recorded: nothing to wait for)."""
    handle = getattr(event, "cuda_event", None)
    if handle is None:
        handle = event._as_parameter_.value
    return int(handle or 0)


class CudaBackend:
    """One node over NVLink: normal mode here, low-latency mode in its LowLatencyEngine (``self.ll``); both report
    through the NVLink buffer's error record (``self.nvl``, its state in ``self.errors``). A Backend
    (deepcomm/backend_protocol.py)."""
    name = "cuda"
    # BF16 x in normal mode; expert ids range-checked on the device, without a host sync, inside the notify kernel
    # of a fresh dispatch, the layout kernel and the low-latency send kernels; every collective call's fingerprint
    # travels in its first exchange and is compared on the device (deepcomm/agreement.py,
    # csrc/runtime/agree_record.hpp), and reject() joins that exchange for a rejected call.
    capabilities = Capabilities(x_dtypes=(torch.bfloat16,), takes_fingerprints=True,
                                checks_expert_ids_on_device=True, checks_layout_ids_on_device=True,
                                checks_low_latency_ids_on_device=LowLatencyEngine.checks_ids_on_device,
                                counts_joined_calls=True, reads_plain_calls=True,
                                capturable=frozenset(("dispatch", "combine", "low_latency_dispatch",
                                                      "low_latency_combine")))

    def __init__(self, group, config, rank: int, world_size: int, device: torch.device):
        C = load_extension()
        if C is None:
            raise RuntimeError("the CUDA extension deepcomm._C is not built")
        _load_flags(C)
        self.C, self.group, self.config = C, group, config
        self.rank, self.world_size, self.device = rank, world_size, device
        self.set_num_sms(config.num_sms)  # before anything is allocated
        if config.low_latency_memory == "nvshmem":  # fail at construction, before any collective, if it is missing
            from ..cuda.nvshmem_library import load_library
            load_library()
        arena, worst = arena_sizes(C, world_size, config.max_tokens_per_rank, config.hidden)
        with torch.cuda.device(device):
            self.nvl = NvlBuffer(C, group, rank, world_size, device, C.COUNTS_MAX_EXPERTS,
                                 config.max_tokens_per_rank, config.hidden, C.TOPK_MAX, arena + worst, config.timeout_s)
            self.comm_stream = torch.cuda.Stream(device)
        self.arena = Arena(self.nvl.arena_ptr, arena, device)
        self._types = OutputTypes(self.arena)
        self._arena_at = self.nvl.layout["arena"]  # the arena's offset in the NVLink buffer
        self._releases_seen = 0  # arena releases already covered by a wait on the caller's stream (_order)
        # When more dispatch outputs are alive than the arena holds (e.g. training keeps every layer's recv_x for
        # backward), a dispatch lands in this bounce area (``worst`` bytes past the arena) and is copied out into
        # ordinary torch tensors.
        self.bounce_offset, self.bounce_bytes = arena, worst
        # with no worst-case block free, a fresh dispatch places its rows exactly after its counts come, or copies
        # them out of the bounce area it went to at once (DEEPCOMM_ARENA_FULL, deepcomm/config.py)
        self._full_copies = resolve_arena_full() == "copy"
        # end-of-call events (recorded once here, so that their CUDA events exist for the C++ side) and the event
        # the communication stream records on the caller's stream to wait for it
        self._events = [torch.cuda.Event() for _ in range(EVENT_RING)]
        self._start_event = torch.cuda.Event()
        for ev in self._events + [self._start_event]:
            ev.record(self.comm_stream)
        self._event_handles = [_event_handle(ev) for ev in self._events]
        self._start_handle = _event_handle(self._start_event)
        self._event_i = 0
        self._event: Optional[torch.cuda.Event] = None
        self._last_stream: Optional[int] = None  # the raw stream the last call ran on
        self._last_end = 0  # the end event of the last call, when it ran on the communication stream
        self._last_captured = False  # the last call was made while a CUDA graph was captured
        self._device_index = device.index if device.index is not None else torch.cuda.current_device()
        self._bounce_pending = False  # a bounced dispatch's copies still read the bounce area (see _bounced)
        self._tag = 0  # the host's number for a fresh dispatch's counts (csrc/runtime/dispatch_counts.hpp)
        self._joined = 0  # normal-mode crossings made (joined_calls)
        self._capacity_rows = world_size * config.max_tokens_per_rank  # rows a rank can receive
        self._work_cache = {}  # fresh dispatch workspace layouts by (T, L, rows) (_work_layout)
        self._work_pool = WorkPool(device)  # waited fresh dispatches' workspaces, taken again once free
        # where each dispatch's rows went (diagnostics, PLACEMENTS): the last one's, and how many of each kind
        self.last_placement: Optional[str] = None
        self.placements = dict.fromkeys(PLACEMENTS, 0)
        self.last_wait_us = 0.0  # host time the last fresh dispatch waited for its counts (diagnostics)
        # the host waits for a fresh dispatch's counts a little longer than the kernels wait for their peers, so a
        # peer that never comes is reported by the device wait (naming it) first
        self._wait_timeout_s = config.timeout_s * 1.5 + 1.0
        # an input error found on the device by an earlier call: raised once the current call has been launched
        # the parts it owns: the error state of its record, shared with the low-latency engine (ll_calls.py)
        self.errors = CallErrors(self.nvl)
        # a normal-mode call meeting a low-latency one on another rank (deepcomm/cuda/mode_meet.py)
        self.meet = ModeMeet(self.nvl, device, normal_exchange=self._exchange_words)
        self.ll = LowLatencyEngine(C, group, rank, world_size, device, self.nvl, self.errors,
                                   config.low_latency_memory, low_latency_blocks(C, device), meet=self.meet)
        # a plain call's arguments checked and read in one crossing (Capabilities.reads_plain_calls; None where
        # torch has no DLPack exchange table)
        self.arg_reader = dispatch_arg_reader(C, world_size, self._device_index, config.hidden,
                                              config.max_tokens_per_rank)

    # ---- plumbing ----
    def _order(self, previous_event: Optional[torch.cuda.Event], async_finish: bool, caller: Optional[int] = None,
               capturing: Optional[bool] = None):
        """Where a new call runs and what it waits for; the C++ side does it with the launches
        (csrc/runtime/nvl_calls.hpp). Returns ``(wait stream, run stream, flags, previous event, end event)``:
        the run stream waits for ``previous`` and, with WAIT_CALLER, for the wait stream; with an end event the
        caller's stream waits for the run stream's end unless ``async_finish``.

        A plain call (no ``previous_event``, not ``async_finish``) runs on the caller's stream itself: the same
        order as the communication stream joined both ways, without the four event operations. A call with either
        runs on the communication stream, which waits for the caller's work (or for ``previous_event``); its end
        event is ``self.event`` (one of a ring, so an event a user holds is re-recorded only calls later, and
        waiting on it then waits for a later call of the same stream: never too early). Consecutive calls never
        overlap: each waits for the stream the previous one ran on. ``caller`` / ``capturing``: the caller's stream
        and whether it is being captured, where the call knows them already (None: asked here)."""
        self.errors.check()
        if caller is None:
            caller = _current_stream(self._device_index)
        comm = self.comm_stream.cuda_stream
        last, last_end = self._last_stream, self._last_end
        # While a CUDA graph is captured, work outside the capture cannot be waited for (and the capture began
        # after it); the calls captured together still follow each other on the capture stream.
        if capturing is None:
            capturing = is_capturing()
        if capturing and not self._last_captured:
            last = None
        self._last_captured = capturing
        if previous_event is None and not async_finish:
            self._last_stream, self._last_end = caller, 0
            if last == comm:  # after a call on the communication stream: wait for its end
                return caller, caller, 0, last_end, 0
            if last not in (None, caller):  # after a plain call on another stream: wait for that stream
                return last, caller, WAIT_CALLER, 0, 0
            return caller, caller, 0, 0, 0
        flags = 0 if async_finish else CALLER_WAITS
        prev = 0
        if previous_event is not None:
            prev = _event_handle(previous_event)
            # A dispatch output freed since the last call may be reused by this one, while work the caller queued
            # after the event may still read it; or the last call ran on the caller's stream: then wait for the
            # caller's stream after all.
            if self.arena.releases != self._releases_seen or self._bounce_pending or last == caller:
                flags |= WAIT_CALLER
        else:
            flags |= WAIT_CALLER
        if last not in (None, caller, comm):  # the last plain call ran on a stream that is no longer current
            # (inside a capture such a stream is the capture's own: the capture does not change streams)
            self.comm_stream.wait_stream(_torch_stream(last, self.device))
        self._releases_seen = self.arena.releases
        self._bounce_pending = False
        self._event_i = (self._event_i + 1) % len(self._events)
        self._event = self._events[self._event_i]
        self._last_stream, self._last_end = comm, self._event_handles[self._event_i]
        return caller, comm, flags, prev, self._last_end

    @property
    def joined_calls(self) -> int:
        """Collective calls that entered their first exchange, counted as they enter (Capabilities.counts_joined_calls):
        every crossing of a normal-mode call and every low-latency first exchange."""
        return self._joined + self.ll.joined

    @property
    def broken_reason(self) -> Optional[str]:
        """Why this Buffer takes no more calls, where a call failed inside its crossing (None otherwise)."""
        return self.nvl.broken_reason

    @property
    def event(self) -> Optional[torch.cuda.Event]:
        """The end of the last call: its end event, or, for a call that ran on the caller's stream, an event
        recorded there now (which also covers what the caller queued after the call: later, never earlier)."""
        last = self._last_stream
        if last is not None and last != self.comm_stream.cuda_stream:
            self._event_i = (self._event_i + 1) % len(self._events)
            self._event = self._events[self._event_i]
            self._event.record(_torch_stream(last, self.device))
        return self._event

    def _after(self, async_finish: bool, inputs) -> None:
        if async_finish:
            # The caller's stream does not wait: keep the inputs' memory from being reused under the kernels.
            for t in inputs:
                if t is not None:
                    try:
                        t.record_stream(self.comm_stream)
                    except RuntimeError:
                        pass  # not from the caching allocator (an arena view): its lifetime is ours already
        self.errors.raise_pending()

    def set_num_sms(self, num_sms: int) -> None:
        # Every block of the normal combine must be resident at once (its reducers wait for other blocks' senders),
        # one block per SM: at most the GPU's SMs (this rank's share where ranks share the GPU: gpu_share.py), and
        # at most the flag capacity.
        sms = usable_sms(self.device)
        limit = min(self.C.MAX_BLOCKS, sms)
        if num_sms > limit:
            raise ValueError(f"num_sms: at most {limit} on the CUDA backend ({sms} SMs{_share_note()}, "
                             f"{self.C.MAX_BLOCKS} flag slots), got {num_sms}")

    def size_bytes(self) -> int:
        """Device bytes this rank holds: the NVLink buffer, plus the low-latency buffer once one was made."""
        return self.nvl.size_bytes + self.ll.buffer_info()["bytes"]

    # ---- layout ----
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        """Local (no collective), on the caller's stream, no host sync: the kernel range-checks the expert ids
        itself; bad ones count nowhere and raise at this rank's next call on the Buffer or synchronize()
        (csrc/kernels/layout.cu). An input error an earlier call left on the device is raised after the launch,
        as every call does."""
        self.errors.check(low_latency=True)  # local: masked ranks do not matter
        T, R = topk_idx.shape[0], self.world_size
        per_rank = torch.empty(R, dtype=torch.int32, device=self.device)
        per_expert = torch.empty(num_experts, dtype=torch.int32, device=self.device)
        in_rank = torch.empty(T, R, dtype=torch.bool, device=self.device)
        self.nvl.ctx.dispatch_layout(topk_idx.data_ptr(), T, topk_idx.shape[1], num_experts, per_rank.data_ptr(),
                                     per_expert.data_ptr(), in_rank.data_ptr(), _current_stream(self._device_index))
        self.errors.raise_pending()
        return per_rank, per_expert, in_rank

    # ---- normal dispatch ----
    def dispatch(self, x: Payload, topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
                 num_experts: Optional[int], handle: Optional[Handle], expert_alignment: int,
                 num_worst_tokens: int = 0, previous_event=None, async_finish: bool = False, fingerprint=None):
        if isinstance(x, (tuple, list)):
            values, scales = x[0], x[1]
        else:
            values, scales = x, None
        K = topk_idx.shape[1] if topk_idx is not None else (topk_weights.shape[1] if topk_weights is not None else 0)
        self._enter_normal()
        call = DispatchCall.of_tensors(values, scales, topk_weights, topk_idx if handle is None else None, K,
                                       handle is None, words_or_none(fingerprint), self._types)
        call.order = self._order(previous_event, async_finish)
        if handle is None:
            recv, handle_out = self._fresh(call, num_experts, expert_alignment, num_worst_tokens)
        else:
            recv = self._cached(call, handle)
            handle_out = handle
        if async_finish:
            self._after(True, (values, scales, topk_idx, topk_weights) + recv.keep)
        else:
            self.errors.raise_pending()
        out_x, out_scales, out_idx, out_w = recv.out
        recv_x = (out_x, out_scales) if scales is not None else out_x
        return recv_x, out_idx, out_w, recv.per_expert, handle_out

    def dispatch_read(self, read: tuple, num_experts: int, expert_alignment: int, handle: Optional[Handle] = None):
        """dispatch() of a plain call (no num_worst_tokens, previous_event or async_finish; with a handle, no
        topk_idx) whose arguments ``arg_reader.fresh`` / ``arg_reader.cached`` checked and read
        (deepcomm/cuda/arg_reader.py), ``read`` being its tuple: the same steps without reading the tensors again."""
        self._enter_normal()
        call = DispatchCall.of_read(read, self._types, handle is None)
        call.order = self._order(None, False, read[3], False)
        if handle is None:
            recv, handle = self._fresh(call, num_experts, expert_alignment, 0)
        else:
            recv = self._cached(call, handle)
        self.errors.raise_pending()
        out_x, out_scales, out_idx, out_w = recv.out
        return (out_x if read[5] is None else (out_x, out_scales)), out_idx, out_w, recv.per_expert, handle

    def _cross(self, call: "DispatchCall", steps: int, reserve_rows: Optional[int], topk_idx_ptr: int, T: int, E: int,
               in_rank_ptr: int, send_pos_ptr: int, notify_out_ptr: int, tag: int, count_matrix_ptr: int,
               invalid_ptr: int, out_block: int, out_rows: int, alignment: int, src_copy_ptr: int):
        """One crossing (the argument order is the binding's): ``steps`` of the call, in the stream order of
        ``call.order`` (from _order). ``reserve_rows`` None: NvlContext.dispatch_call, rows into ``out_block`` (the
        bounce area, or no payload); else NvlContext.dispatch_into, rows into an arena block it reserves for that
        many rows, the outputs' views made in the same crossing (None: no such block free, nothing launched)."""
        self._joined += 1  # counted before the crossing: an error inside it may come after the launch
        wait, run, flags, prev, end = call.order
        head = (steps | flags, wait, run, prev, self._start_handle, end,
                topk_idx_ptr, T, call.K, E, in_rank_ptr, send_pos_ptr, notify_out_ptr, tag,
                call.x_ptr, call.x_row_bytes, call.scales_ptr, call.scale_row_bytes,
                call.weights_ptr, count_matrix_ptr, invalid_ptr)
        tail = (self.config.num_sms, alignment, src_copy_ptr, self._wait_timeout_s, call.words)
        try:
            if reserve_rows is None:
                return self.nvl.ctx.dispatch_call(*head, out_block, out_rows, *tail)
            return self.nvl.ctx.dispatch_into(self.arena.core, self._arena_at, reserve_rows, call.x_type,
                                              call.scale_type, call.fresh, call.with_weights, *head, out_rows, *tail)
        except Exception as e:
            self.nvl.set_broken_by("dispatch" if call.fresh else "cached dispatch", e)
            raise

    def _fresh(self, call: "DispatchCall", num_experts: int, expert_alignment: int, num_worst_tokens: int):
        R, T = self.world_size, call.T
        L = num_experts // R
        # One int32 allocation: send_pos | notify_out (count matrix, tokens per local expert, bad-id counts) | the
        # handle's src_idx copy | is_token_in_rank's bytes, carved by FreshDispatchWork (csrc/runtime/nvl_layout.hpp);
        # the handle's views of it are made when first read (deepcomm/handle.py WorkspaceViews).
        send_at, notify_at, _, per_expert_at, bad_at, src_at, in_rank_at, total, specs = self._work_layout(
            T, L, num_worst_tokens or self._capacity_rows)
        if num_worst_tokens:  # may be captured in a CUDA graph, whose replays write it: never pooled
            slot, work = None, torch.empty(total, dtype=torch.int32, device=self.device)
        else:
            slot = self._work_pool.take(total)
            work = slot.work
        work_ptr = work.data_ptr()
        send_ptr = work_ptr + 4 * send_at
        notify_ptr = work_ptr + 4 * notify_at
        invalid_ptr = work_ptr + 4 * bad_at
        src_ptr = work_ptr + 4 * src_at
        args = (call.idx_ptr, T, num_experts, work_ptr + 4 * in_rank_at, send_ptr, notify_ptr)
        bounce_block = self._arena_at + self.bounce_offset
        self._tag += 1
        if num_worst_tokens:
            # No host wait (graph-capturable): worst-case-sized outputs, counts stay on the device, and bad expert
            # ids stop the dispatch kernel on every rank (reported at the next call).
            rows = num_worst_tokens
            steps = BEGIN | NOTIFY | PAYLOAD | REPORT_INVALID
            res = self._cross(call, steps | FINISH, rows, *args, 0, notify_ptr, invalid_ptr, 0, rows, 1, src_ptr)
            if res is None:  # no block free: into the bounce area
                res = self._cross(call, steps, None, *args, 0, notify_ptr, invalid_ptr, bounce_block, rows, 1, src_ptr)
                out = self._bounced(call, rows)
            else:
                out = call.typed(res[5])
                self._placed("arena")
            per_expert = self._device_counts(call, work[per_expert_at:per_expert_at + L], expert_alignment)
        else:
            # The payload is launched right behind notify, into a block reserved for the worst case (-1 rows: the
            # kernel carves it for the rows that arrive); the wait for the counts overlaps it, and the block's unused
            # tail goes back to the arena.
            res = self._cross(call, BEGIN | NOTIFY | PAYLOAD | WAIT | FINISH, self._capacity_rows, *args, self._tag,
                              notify_ptr, invalid_ptr, 0, -1, expert_alignment, src_ptr)
            if res is not None:
                self._fresh_status(res, num_experts)
                out = call.typed(res[5])
                self._placed("arena")
            elif self._full_copies:
                # The arena has no worst-case block free: the same launches into the bounce area, copied out.
                res = self._cross(call, BEGIN | NOTIFY | PAYLOAD | WAIT | FINISH, None, *args, self._tag, notify_ptr,
                                  invalid_ptr, bounce_block, -1, expert_alignment, src_ptr)
                self._fresh_status(res, num_experts)
                out = self._bounced(call, res[1])
            else:
                # The arena has no worst-case block free: learn the size first, then place the rows exactly.
                res = self._cross(call, BEGIN | NOTIFY | WAIT, None, *args, self._tag, notify_ptr, invalid_ptr, 0, -1,
                                  expert_alignment, 0)
                self._fresh_status(res, num_experts)
                rows = res[1]
                placed = self._cross(call, PAYLOAD | FINISH, rows, *args, 0, notify_ptr, 0, 0, rows, 1, src_ptr)
                if placed is None:
                    self._cross(call, PAYLOAD, None, *args, 0, notify_ptr, 0, bounce_block, rows, 1, src_ptr)
                    out = self._bounced(call, rows)
                else:
                    out = call.typed(placed[5])
                    self._placed("exact")
            self.last_wait_us = res[6]
            per_expert = res[4]
        n = res[1]
        recv = Received(out, per_expert, (work,))
        handle = Handle.of_fresh_dispatch(num_experts, T, call.H, n,
                                          WorkspaceViews(work, specs, n, work_ptr, slot), per_expert)
        return recv, handle

    def _device_counts(self, call: "DispatchCall", counts: torch.Tensor, alignment: int) -> torch.Tensor:
        """The aligned per-expert counts of a worst-case dispatch, computed in stream order after its kernels: on
        the caller's stream itself for a plain call (no stream switch), else on the communication stream."""
        run = call.order[1]
        if run == _current_stream(self._device_index):
            return (counts + (alignment - 1)) // alignment * alignment
        with torch.cuda.stream(_torch_stream(run, self.device)):
            per_expert = (counts + (alignment - 1)) // alignment * alignment
        per_expert.record_stream(torch.cuda.current_stream(self.device))
        return per_expert

    def _fresh_status(self, res, num_experts: int) -> None:
        """A fresh dispatch's wait came back without counts (timeout) or with bad expert ids (a ValueError on every
        rank: all of them read the same counts, and their payload kernels returned at once; dispatch_into gave its
        block back)."""
        status = res[0]
        if status == 0:
            return
        if status == 1:
            self.errors.check()  # a device wait that timed out raises here, naming its peer and stage
            self.nvl.broken = True
            raise CommTimeoutError(self.rank, None, "notify:counts (host)",
                                   f"no counts after {self._wait_timeout_s:.1f} s")
        if status == 3:  # the ranks' fingerprints differ: nothing was dispatched on any rank (agree_record.py)
            raise dispatch_disagreement(self.C, self.nvl.counts_host, self.world_size, self.rank, self.nvl.owed)
        if res[3]:
            # The same ids have usually gone through get_dispatch_layout just before, whose kernel ran ahead of the
            # counts waited for: its record joins this error instead of raising again at the next call.
            self.errors.check()
        earlier = self.errors.take_pending()
        also = f" (also, from an earlier call: {earlier})" if earlier is not None else ""
        if res[3]:
            raise ValueError(f"topk_idx: {res[3]} expert ids outside [-1, {num_experts}) "
                             f"(num_experts={num_experts}); nothing was dispatched{also}")
        raise ValueError(f"topk_idx: another rank passed expert ids outside [-1, {num_experts}); "
                         f"nothing was dispatched{also}")

    def _cached(self, call: "DispatchCall", handle: Handle):
        n = handle.num_recv
        args = (0, handle.num_tokens, handle.num_experts, 0, field_ptr(handle, "send_pos"), 0, 0,
                field_ptr(handle, "count_matrix"), 0)
        res = self._cross(call, BEGIN | BUMP | PAYLOAD | FINISH, n, *args, 0, n, 1, 0)
        if res is not None:
            out = call.typed(res[5])
            self._placed("arena")
        else:  # no block free: into the bounce area
            self._cross(call, BEGIN | BUMP | PAYLOAD, None, *args, self._arena_at + self.bounce_offset, n, 1, 0)
            out = self._bounced(call, n)
        per_expert = handle.num_recv_tokens_per_expert
        per_expert = per_expert.clone() if isinstance(per_expert, torch.Tensor) else list(per_expert)
        return Received(out, per_expert, ())

    def _work_layout(self, T: int, L: int, rows: int) -> tuple:
        """A fresh dispatch's workspace offsets (int32 elements) for ``T`` tokens, ``L`` local experts and room for
        ``rows`` received rows, as the C++ side computes them (FreshDispatchWork): ``(send_pos, notify_out,
        count_matrix, per_expert, bad_all, src_idx, in_rank, total)``, then the handle's views of it (the specs of
        deepcomm/handle.py WorkspaceViews). Cached: a crossing per call costs host time."""
        key = (T, L, rows)
        lay = self._work_cache.get(key)
        if lay is None:
            w = self.C.fresh_dispatch_work(T, self.world_size, L, rows)
            R = self.world_size
            specs = {"is_token_in_rank": ((T, R), (R, 1), 4 * w["in_rank"], torch.bool),
                     "send_pos": ((T, R), (R, 1), w["send_pos"], None),
                     "count_matrix": ((R, R), (R, 1), w["count_matrix"], None),
                     "recv_src_idx": (None, (1,), w["src_idx"], None)}  # (num_recv,)
            lay = _remember(self._work_cache, key, tuple(w[k] for k in WORK_PARTS) + (specs,))
        return lay

    @property
    def arena_outputs(self) -> int:
        """How many worst-case dispatch outputs the arena holds at once (DEEPCOMM_ARENA_OUTPUTS)."""
        return self.arena.nbytes // self.bounce_bytes

    @property
    def arena_full(self) -> str:
        """What a dispatch does when the arena is full: "copy" or "place" (DEEPCOMM_ARENA_FULL)."""
        return "copy" if self._full_copies else "place"

    def _bounced(self, call: "DispatchCall", n: int):
        """The outputs of a dispatch whose ``n`` rows went to the bounce area (the arena was full), copied into
        ordinary tensors on the run stream; the call's end is recorded after the copies."""
        out = carve(self.arena, (self.bounce_offset, self.bounce_bytes), n, call, bounce=True)
        wait, run, flags, _, end = call.order
        run_stream = _torch_stream(run, self.device)
        with torch.cuda.stream(run_stream):  # behind the payload kernel on the stream the call ran on
            out = tuple(t.clone() if t is not None else None for t in out)
        caller = torch.cuda.current_stream(self.device)
        for t in out:
            if t is not None:
                t.record_stream(caller)
        if end:  # the run stream is the communication stream: record its end, join the caller unless async
            self._event.record(run_stream)
            if flags & CALLER_WAITS:
                caller.wait_event(self._event)
        self._bounce_pending = True  # the next call must not overwrite the bounce area under these copies
        if not self.bounced_calls:  # a cost the caller cannot see otherwise: said once per Buffer
            logger.warning(f"rank {self.rank}: this Buffer's dispatch output arena is full (more dispatch outputs "
                           f"alive than its {self.arena_outputs} worst-case ones), so dispatches "
                           "now go through its bounce area and are copied out, one more device copy each; free "
                           "dispatch outputs (recv_x) once used, or set DEEPCOMM_ARENA_OUTPUTS=N when the Buffer is "
                           "built (docs/tuning.md). Said once per Buffer.")
        self._placed("bounce")
        return out

    @property
    def bounced_calls(self) -> int:
        """Dispatches whose rows went through the bounce area (diagnostics)."""
        return self.placements["bounce"]

    def _placed(self, placement: str) -> None:
        self.last_placement = placement
        self.placements[placement] += 1

    # ---- normal combine ----
    def combine(self, x: torch.Tensor, handle: Handle, topk_weights: Optional[torch.Tensor],
                previous_event=None, async_finish: bool = False, use_fp8: bool = False, fingerprint=None):
        K = topk_weights.shape[1] if topk_weights is not None else 0
        self._enter_normal()
        order = self._order(previous_event, async_finish)
        out, out_w = self._combine(order, x.data_ptr(), topk_weights.data_ptr() if topk_weights is not None else 0,
                                   topk_weights is not None, x.shape[0], x.shape[1], K, x.dtype, use_fp8, handle,
                                   words_or_none(fingerprint))
        if async_finish:
            self._after(True, (x, topk_weights, handle.recv_src_idx, handle.count_matrix, handle.send_pos, out, out_w))
        else:
            self.errors.raise_pending()
        return out, out_w

    def combine_read(self, read: tuple, handle: Handle):
        """combine() of a plain call (no previous_event or async_finish) whose arguments ``arg_reader.combine``
        checked and read (deepcomm/cuda/arg_reader.py), ``read`` being its tuple."""
        N, H, K, caller, x_ptr, w_ptr, with_weights, use_fp8, words = read
        self._enter_normal()
        order = self._order(None, False, caller, False)
        out = self._combine(order, x_ptr, w_ptr, with_weights, N, H, K, torch.bfloat16, use_fp8, handle, words)
        self.errors.raise_pending()
        return out

    def _combine(self, order: tuple, x_ptr: int, w_ptr: int, with_weights: bool, N: int, H: int, K: int, dtype,
                 use_fp8: bool, handle: Handle, words: tuple):
        """The combine's outputs, allocated, and its one crossing (NvlContext.combine_call) in ``order``."""
        wait, run, flags, prev, end = order
        T = handle.num_tokens
        out = torch.empty(T, H, dtype=dtype, device=self.device)
        out_w = torch.empty(T, K, dtype=torch.float32, device=self.device) if with_weights else None
        self._joined += 1
        try:
            self.nvl.ctx.combine_call(flags, wait, run, prev, self._start_handle, end, self.config.num_sms, x_ptr,
                                      w_ptr, field_ptr(handle, "recv_src_idx"), field_ptr(handle, "count_matrix"),
                                      field_ptr(handle, "send_pos"), out.data_ptr(),
                                      out_w.data_ptr() if out_w is not None else 0, N, T, H, K, use_fp8, words)
        except Exception as e:
            self.nvl.set_broken_by("combine", e)
            raise
        return out, out_w

    # ---- low-latency mode and masking (the engine, ll_calls.py) ----
    def low_latency_dispatch(self, *args, **kwargs):
        return self.ll.dispatch(*args, **kwargs)

    def low_latency_combine(self, *args, **kwargs):
        return self.ll.combine(*args, **kwargs)

    def low_latency_buffer_info(self) -> dict:
        return self.ll.buffer_info()

    @property
    def masked(self) -> frozenset:
        return self.ll.masked

    def mask_ranks(self, ranks: frozenset) -> None:
        self.ll.mask_ranks(ranks)

    def unmask_ranks(self) -> None:
        self.ll.unmask_ranks()

    # ---- a call this rank rejected ----
    def reject(self, fingerprint, handle=None) -> None:
        """This rank's own validation rejected its call: take part in the call's first exchange with
        ``fingerprint`` (its REJECTED word set), so every peer stops that call naming this rank; nothing moves. No
        host wait. A Buffer that can run no call (a timeout, masked ranks) sends nothing: its next call says why.
        ``handle``: the rejected call's handle argument (a low-latency combine joins its slot)."""
        if fingerprint[agreement.Word.OP] in (agreement.Op.LOW_LATENCY_DISPATCH, agreement.Op.LOW_LATENCY_COMBINE):
            self.ll.reject(fingerprint, handle=handle)
            return
        try:
            self._enter_normal()
            wait, run, flags, prev, _ = self._order(None, False)
        except (CommTimeoutError, RuntimeError):
            return
        self.nvl.ctx.agree_reject(tuple(fingerprint), flags, wait, run, prev, self._start_handle)

    def _exchange_words(self, fingerprint: tuple) -> None:
        """A normal-mode call that only exchanges ``fingerprint`` with every rank and compares (a difference goes to
        the error record) and moves nothing: the first exchange of the first low-latency call (ModeMeet)."""
        self._enter_normal()
        wait, run, flags, prev, _ = self._order(None, False)
        self.nvl.ctx.agree_reject(fingerprint, flags, wait, run, prev, self._start_handle, compare=True)

    def _enter_normal(self) -> None:
        """Before a normal-mode call: the normal-mode calls this rank owes after meeting a peer's low-latency call
        (deepcomm/cuda/mode_meet.py), each a call that takes part in the first exchange and moves nothing."""
        if self.meet.low_latency is False and not self.nvl.owed:  # no switch of mode, nothing owed
            return
        for words in self.meet.enter(False, self.errors):
            wait, run, flags, prev, _ = self._order(None, False)
            self.nvl.ctx.agree_reject(tuple(words), flags, wait, run, prev, self._start_handle)

    # ---- lifetime ----
    def synchronize(self) -> None:
        # low-latency kernels run on the caller's streams, normal mode on the communication stream: wait for all
        torch.cuda.synchronize(self.device)
        self.errors.check(low_latency=True)
        self.errors.raise_pending()

    def destroy(self) -> None:
        """Local (no collective): safe after a timeout, even with a dead peer."""
        self._work_pool.clear()
        try:
            self.ll.close()
        finally:
            self.nvl.close()
