"""CudaBackend: normal-mode layout, dispatch and combine on the NVLink kernels of ``deepcomm._C``.

Same method signatures and results as ``deepcomm.reference.ReferenceBackend``; the Buffer validates inputs
before calling in. Every call runs on a communication stream that first waits for the caller's stream (or for
``previous_event``); unless ``async_finish`` is set, the caller's stream then waits for the communication
stream, so results are ready in stream order. ``self.event`` is recorded at the end of every call.
Low-latency mode (deepcomm/cuda/ll_calls.py) uses its own double-buffered buffer and runs on the caller's stream.
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple, Union

import torch

from .._ext import load_extension
from ..gpu_share import GPU_SMS_ENV, usable_sms
from ..handle import Handle
from .align import round_up
from .arena import Arena, as_device_bytes
from .ll_calls import LowLatencyCalls, low_latency_blocks
from .nvl_buffer import NvlBuffer

Payload = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]

LOCAL_EXPERTS_CAP = 1024  # experts per rank the count exchange can carry
TOPK_MAX = 32             # one lane per top-k slot in the kernels
ARENA_OUTPUTS = 4         # worst-case dispatch outputs the arena holds at once (plus one bounce area)
OUTPUTS = ("x", "scales", "topk_idx", "topk_weights", "src_idx")


def _share_note() -> str:
    return f" by {GPU_SMS_ENV}" if os.environ.get(GPU_SMS_ENV, "").strip() else ""


def _align(counts: List[int], alignment: int) -> List[int]:
    return [round_up(c, alignment) for c in counts]


def _worst_output_bytes(C, rows: int, hidden: int) -> int:
    bf16 = C.dispatch_out_layout(rows, hidden * 2, 0, TOPK_MAX)["total"]
    fp8 = C.dispatch_out_layout(rows, hidden, hidden // 128 * 4, TOPK_MAX)["total"]
    return max(bf16, fp8)


def arena_sizes(C, world_size: int, max_tokens: int, hidden: int) -> Tuple[int, int]:
    """``(arena, bounce)`` bytes: room for ARENA_OUTPUTS worst-case dispatch outputs, and one more for the bounce
    area used when the arena is full. The NVLink buffer's arena region holds both."""
    worst = _worst_output_bytes(C, world_size * max_tokens, hidden)
    return ARENA_OUTPUTS * worst, worst


class CudaBackend(LowLatencyCalls):
    name = "cuda"
    x_dtypes = (torch.bfloat16,)  # non-FP8 x of normal dispatch/combine
    # Expert ids are range-checked on the device, without a host sync, inside the notify kernel of a fresh dispatch;
    # the Buffer then skips its own value checks (low-latency mode: LowLatencyCalls.checks_low_latency_ids_on_device).
    checks_expert_ids_on_device = True

    def __init__(self, group, config, rank: int, world_size: int, device: torch.device):
        C = load_extension()
        if C is None:
            raise RuntimeError("the CUDA extension deepcomm._C is not built")
        self.C, self.group, self.config = C, group, config
        self.rank, self.world_size, self.device = rank, world_size, device
        self.set_num_sms(config.num_sms)  # before anything is allocated
        if config.low_latency_memory == "nvshmem":  # fail at construction, before any collective, if it is missing
            from .nvshmem_library import load_library
            load_library()
        arena, worst = arena_sizes(C, world_size, config.max_tokens_per_rank, config.hidden)
        with torch.cuda.device(device):
            self.nvl = NvlBuffer(C, group, rank, world_size, device, LOCAL_EXPERTS_CAP, config.max_tokens_per_rank,
                                 config.hidden, TOPK_MAX, arena + worst, config.timeout_s)
            self.comm_stream = torch.cuda.Stream(device)
        self.arena = Arena(self.nvl.arena_ptr, arena, device)
        self._releases_seen = 0  # arena releases already covered by a wait on the caller's stream (_begin)
        # When more dispatch outputs are alive than the arena holds (e.g. training keeps every layer's recv_x for
        # backward), a dispatch lands in this bounce area and is copied out into ordinary torch tensors.
        self.bounce = as_device_bytes(self.nvl.arena_ptr + arena, worst, device)
        self.bounce_offset = arena
        self.event: Optional[torch.cuda.Event] = None
        # an input error found on the device by an earlier call: raised once the current call has been launched
        self._pending_input: Optional[ValueError] = None
        self._ll = None  # the low-latency buffer (ll_calls.py), made at the first low-latency call
        self.ll_memory = config.low_latency_memory
        self.ll_blocks = low_latency_blocks(C, device)

    # ---- plumbing ----
    def _begin(self, previous_event: Optional[torch.cuda.Event]) -> torch.cuda.Stream:
        """Order the communication stream after the caller's work and start a new collective: bump the device
        sequence number of the NVLink context."""
        self._check()
        caller = torch.cuda.current_stream(self.device)
        if previous_event is not None:
            self.comm_stream.wait_event(previous_event)
            # A dispatch output freed since the last call may be reused by this one, while work the caller queued
            # after the event may still read it: then wait for the caller's stream after all.
            if self.arena.releases != self._releases_seen:
                self.comm_stream.wait_stream(caller)
        else:
            self.comm_stream.wait_stream(caller)
        self._releases_seen = self.arena.releases
        self.nvl.ctx.bump_seq(self.comm_stream.cuda_stream)
        return caller

    def _end(self, caller: torch.cuda.Stream, async_finish: bool, inputs) -> None:
        self.event = self.comm_stream.record_event()
        if async_finish:
            # The caller's stream does not wait: keep the inputs' memory from being reused under the kernels.
            for t in inputs:
                if t is not None:
                    try:
                        t.record_stream(self.comm_stream)
                    except RuntimeError:
                        pass  # not from the caching allocator (an arena view): its lifetime is ours already
        else:
            caller.wait_stream(self.comm_stream)
        self._raise_pending()

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
        return self.nvl.size_bytes + (self._ll.layout["total"] if self._ll is not None else 0)

    # ---- layout ----
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        T = topk_idx.shape[0]
        R = self.world_size
        per_rank = torch.empty(R, dtype=torch.int32, device=self.device)
        per_expert = torch.empty(num_experts, dtype=torch.int32, device=self.device)
        in_rank = torch.empty(T, R, dtype=torch.bool, device=self.device)
        stream = torch.cuda.current_stream(self.device)
        self.C.get_dispatch_layout(topk_idx.data_ptr(), T, topk_idx.shape[1], num_experts, R, per_rank.data_ptr(),
                                   per_expert.data_ptr(), in_rank.data_ptr(), 0, stream.cuda_stream)
        return per_rank, per_expert, in_rank

    # ---- normal dispatch ----
    def dispatch(self, x: Payload, topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
                 num_experts: Optional[int], handle: Optional[Handle], expert_alignment: int,
                 num_worst_tokens: int = 0, previous_event=None, async_finish: bool = False):
        R = self.world_size
        is_pair = isinstance(x, (tuple, list))
        values, scales = (x[0], x[1]) if is_pair else (x, None)
        T, H = values.shape
        x_row_bytes = H * values.element_size()
        scale_row_bytes = scales.shape[1] * scales.element_size() if scales is not None else 0
        K = topk_idx.shape[1] if topk_idx is not None else (topk_weights.shape[1] if topk_weights is not None else 0)
        caller = self._begin(previous_event)
        comm = self.comm_stream
        invalid_count = None
        # Tensors are allocated on the caller's stream (kernels get the communication stream explicitly);
        # the few torch ops that must follow the kernels run under `with torch.cuda.stream(comm)`.
        if handle is None:
            L = num_experts // R
            # one int32 workspace: send_pos [T, R] | notify_out [R*R + L + 2] | per_rank [R] | per_expert [E]
            n_out = R * R + L + 2
            work = torch.empty(T * R + n_out + R + num_experts, dtype=torch.int32, device=self.device)
            send_pos = work[:T * R].view(T, R)
            notify_out = work[T * R:T * R + n_out]
            per_rank = work[T * R + n_out:T * R + n_out + R]
            per_expert = work[T * R + n_out + R:]
            in_rank = torch.empty(T, R, dtype=torch.bool, device=self.device)
            self.nvl.ctx.notify_dispatch(topk_idx.data_ptr(), T, K, num_experts, per_rank.data_ptr(),
                                         per_expert.data_ptr(), in_rank.data_ptr(), send_pos.data_ptr(),
                                         notify_out.data_ptr(), comm.cuda_stream)
            count_matrix = notify_out[:R * R].view(R, R)
            if num_worst_tokens:
                # No host sync (graph-capturable): worst-case-sized outputs, counts stay on the device, and
                # bad expert ids stop the dispatch kernel on every rank (reported at the next call).
                num_recv = num_worst_tokens
                invalid_count = notify_out[R * R + L:R * R + L + 1]
                with torch.cuda.stream(comm):
                    counts = notify_out[R * R:R * R + L]
                    per_expert_out = (counts + (expert_alignment - 1)) // expert_alignment * expert_alignment
                per_expert_out.record_stream(caller)
            else:
                with torch.cuda.stream(comm):
                    host = notify_out.cpu().tolist()
                num_recv, per_expert_out = self._sizes_from_counts(host, num_experts, expert_alignment)
        else:
            L = handle.num_experts // R
            in_rank, send_pos, count_matrix = handle.is_token_in_rank, handle.send_pos, handle.count_matrix
            num_recv = handle.num_recv
            per_expert_out = handle.num_recv_tokens_per_expert
            per_expert_out = per_expert_out.clone() if torch.is_tensor(per_expert_out) else list(per_expert_out)
            topk_idx = None

        scale_cols = scales.shape[1] if scales is not None else 0
        lay = self.C.dispatch_out_layout(num_recv, x_row_bytes, scale_row_bytes, K)
        reserved = self.arena.reserve(lay["total"])
        bounced = reserved is None
        if bounced:
            reserved = (self.bounce_offset, lay["total"])
        base = self.nvl.layout["arena"] + reserved[0]
        try:
            self.nvl.ctx.dispatch(self.config.num_sms, values.data_ptr(), x_row_bytes,
                                  scales.data_ptr() if scales is not None else 0, scale_row_bytes,
                                  topk_idx.data_ptr() if topk_idx is not None else 0,
                                  topk_weights.data_ptr() if topk_weights is not None else 0, K, T, L,
                                  send_pos.data_ptr(), count_matrix.data_ptr(),
                                  invalid_count.data_ptr() if invalid_count is not None else 0,
                                  [base + lay[k] for k in OUTPUTS], num_recv, comm.cuda_stream)
        except Exception:
            if not bounced:  # the range never became a tensor: give it back
                self.arena.release(*reserved)
            raise
        block = self.bounce if bounced else self.arena.tensor(*reserved)
        out = self._carve_outputs(block, lay, num_recv, H, values.dtype,
                                  scales.dtype if scales is not None else None, scale_cols, K,
                                  topk_idx is not None, topk_weights is not None)
        if bounced:
            with torch.cuda.stream(comm):
                out = {k: (v.clone() if v is not None else None) for k, v in out.items()}
            for v in out.values():
                if v is not None:
                    v.record_stream(caller)
        if handle is None:
            with torch.cuda.stream(comm):
                recv_src_idx = out["src_idx"].clone()
            recv_src_idx.record_stream(caller)
        else:
            recv_src_idx = handle.recv_src_idx
        made_here = (work, in_rank) if handle is None else ()
        self._end(caller, async_finish, (values, scales, topk_idx, topk_weights) + made_here)

        recv_x = (out["x"], out["scales"]) if is_pair else out["x"]
        if handle is not None:
            return recv_x, None, out["topk_weights"], per_expert_out, handle
        new_handle = Handle(buffer_id=-1, num_experts=num_experts, num_tokens=T, hidden=H, num_recv=num_recv,
                            is_token_in_rank=in_rank, send_pos=send_pos, count_matrix=count_matrix,
                            recv_src_idx=recv_src_idx, num_recv_tokens_per_expert=per_expert_out)
        return recv_x, out["topk_idx"], out["topk_weights"], per_expert_out, new_handle

    def _sizes_from_counts(self, host: List[int], num_experts: int, expert_alignment: int):
        """Rows to receive and rows per local expert, from the counts the one host sync of a fresh dispatch read.
        From that sync to the dispatch launch the GPU idles, so this is plain Python on one list."""
        R, rank = self.world_size, self.rank
        L = num_experts // R
        self._check()
        bad_all, bad_mine = host[R * R + L], host[R * R + L + 1]
        # this call's bad ids: every rank has the same counts and stops here alike (no kernel follows)
        if bad_mine or bad_all:
            earlier, self._pending_input = self._pending_input, None
            also = f" (also, from an earlier call: {earlier})" if earlier is not None else ""
            if bad_mine:
                raise ValueError(f"topk_idx: {bad_mine} expert ids outside [-1, {num_experts}) "
                                 f"(num_experts={num_experts}); nothing was dispatched{also}")
            raise ValueError(f"topk_idx: another rank passed expert ids outside [-1, {num_experts}); "
                             f"nothing was dispatched{also}")
        return sum(host[s * R + rank] for s in range(R)), _align(host[R * R:R * R + L], expert_alignment)

    @staticmethod
    def _carve_outputs(block: torch.Tensor, lay, n: int, hidden: int, dtype: torch.dtype,
                       scale_dtype: Optional[torch.dtype], scale_cols: int, K: int, with_idx: bool,
                       with_weights: bool):
        """Views of one arena block as the dispatch outputs (csrc/runtime/nvl_layout.hpp, DispatchOutLayout)."""

        def carve(name, count, dt, shape):
            return block[lay[name]:lay[name] + count * dt.itemsize].view(dt).view(*shape)

        return {
            "x": carve("x", n * hidden, dtype, (n, hidden)),
            "scales": carve("scales", n * scale_cols, scale_dtype, (n, scale_cols)) if scale_dtype is not None else None,
            "topk_idx": carve("topk_idx", n * K, torch.int64, (n, K)) if with_idx else None,
            "topk_weights": carve("topk_weights", n * K, torch.float32, (n, K)) if with_weights else None,
            "src_idx": carve("src_idx", n, torch.int32, (n,)),
        }

    # ---- normal combine ----
    def combine(self, x: torch.Tensor, handle: Handle, topk_weights: Optional[torch.Tensor],
                previous_event=None, async_finish: bool = False, use_fp8: bool = False):
        T, H = handle.num_tokens, x.shape[1]
        K = topk_weights.shape[1] if topk_weights is not None else 0
        caller = self._begin(previous_event)
        out = torch.empty(T, H, dtype=x.dtype, device=self.device)
        out_w = torch.empty(T, K, dtype=torch.float32, device=self.device) if topk_weights is not None else None
        self.nvl.ctx.combine(self.config.num_sms, x.data_ptr(),
                             topk_weights.data_ptr() if topk_weights is not None else 0,
                             handle.recv_src_idx.data_ptr(), handle.count_matrix.data_ptr(),
                             handle.send_pos.data_ptr(), out.data_ptr(), out_w.data_ptr() if out_w is not None else 0,
                             x.shape[0], T, H, K, self.comm_stream.cuda_stream, use_fp8)
        self._end(caller, async_finish, (x, topk_weights, handle.recv_src_idx, handle.count_matrix,
                                         handle.send_pos, out, out_w))
        return out, out_w

    # ---- lifetime ----
    def synchronize(self) -> None:
        # low-latency kernels run on the caller's streams, normal mode on the communication stream: wait for all
        torch.cuda.synchronize(self.device)
        self._check(low_latency=True)
        self._raise_pending()

    def destroy(self) -> None:
        """Local (no collective): safe after a timeout, even with a dead peer."""
        try:
            self._close_low_latency()
        finally:
            self.nvl.close()
