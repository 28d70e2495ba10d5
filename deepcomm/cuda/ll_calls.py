"""Low-latency mode of the CUDA backends: the engine a backend owns (CudaBackend, deepcomm/nvlink/backend.py, and the
internode backend, deepcomm/internode/backend.py) over the double-buffered low-latency buffer
(deepcomm/cuda/ll_buffer.py): the kernel launches with and without a receive hook, agreement for calls a rank
rejected, and masking lost ranks. Everything runs on the caller's stream with no host sync, so calls can be
captured in CUDA graphs; everything a dispatch returns is a view of the buffer, valid until the same slot is used
again two low-latency dispatches later.

The engine is given the backend's error record (``record``: timeouts, the mask, the agreement record; the NVLink
buffer is one, deepcomm/cuda/error_record.py) and the CallErrors over it (call_errors.py), which the backend's
normal mode shares.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from .. import agreement
from ..errors import CommTimeoutError
from ..gpu_share import shares_gpu, usable_sms
from ..handle import LowLatencyHandle
from ..validation import is_capturing
from .agree_record import words_or_none
from .host_words import HostWords
from .ll_buffer import LlBuffer, pdl_mode


def _noop() -> None:
    return None


def low_latency_blocks(C, device: torch.device) -> int:
    """Blocks of every low-latency kernel: one per SM (they are short, and hook mode holds none while waiting),
    at most the flag capacity (one per SM of this rank's share where ranks share the GPU: gpu_share.py);
    DEEPCOMM_LL_NUM_SMS overrides it (every rank must use the same number). Where ranks share the GPU and the
    kernels launch with an early trigger (DEEPCOMM_LL_PDL=1), half the share: the next kernel's blocks sit on the
    SMs beside the running one's, and ranks whose blocks filled the GPU would keep a peer's blocks from starting."""
    env = os.environ.get("DEEPCOMM_LL_NUM_SMS")
    if env:
        n = int(env)
        if not 1 <= n <= C.MAX_BLOCKS:
            raise ValueError(f"DEEPCOMM_LL_NUM_SMS: expected 1..{C.MAX_BLOCKS}, got {env}")
        return n
    n = min(usable_sms(device), C.MAX_BLOCKS)
    if shares_gpu() and pdl_mode() == 1:
        n = max(1, n // 2)
    return n


def _slot_of(handle, latest: int) -> int:
    """The buffer slot a low-latency combine of ``handle`` uses (LowLatencyHandle.slot), else ``latest``."""
    slot = getattr(handle, "slot", None)
    return slot if isinstance(handle, LowLatencyHandle) and slot in (0, 1) else latest


class LowLatencyEngine:
    # the low-latency send kernels check expert ids on the device (no host sync: calls stay graph-capturable), so
    # the Buffer skips its own value checks
    checks_ids_on_device = True

    def __init__(self, C, group, rank: int, world_size: int, device: torch.device, record, errors, memory: str,
                 blocks: int, meet=None):
        self.C, self.group, self.rank, self.world_size, self.device = C, group, rank, world_size, device
        self.record, self.errors = record, errors
        # CudaBackend's ModeMeet (mode_meet.py): a low-latency call meeting a normal-mode one on another rank
        self.meet = meet
        self._slot_of_call = {}  # the buffer slot of each recent low-latency dispatch, by its call number
        self.memory = memory  # "ipc" or "nvshmem" (deepcomm.config.LL_MEMORY_KINDS)
        self.blocks = blocks  # blocks of every low-latency kernel (low_latency_blocks)
        self.buffer: Optional[LlBuffer] = None  # made at the first call (_buffer_for)
        # calls that entered their first exchange (a host exchange of a new shape, or a launch), counted as they
        # enter: CudaBackend.joined_calls (deepcomm/backend_protocol.py, Capabilities.counts_joined_calls)
        self.joined = 0
        self.host_words = HostWords(group, rank, world_size)  # the words of a call that makes the buffer

    def buffer_info(self) -> dict:
        """Which memory the low-latency buffer uses and its bytes (0 until the first low-latency call)."""
        return {"memory": self.memory, "bytes": self.buffer.layout["total"] if self.buffer is not None else 0}

    def close(self) -> None:
        """Free the low-latency buffer, if one was made, once this device is idle (local, no collective)."""
        if self.buffer is not None:
            ll, self.buffer = self.buffer, None
            torch.cuda.synchronize(self.device)
            if self.meet is not None:
                self.meet.unlink(ll)
            ll.close()

    def _buffer_for(self, num_experts: int, max_tokens: int, hidden: int, fingerprint=None) -> LlBuffer:
        """The low-latency buffer for this shape; (re)made collectively on the first call of a new shape. Its
        layout follows the shape, so before it is made every rank's fingerprint of the call is compared in a
        host exchange (``fingerprint``: this call's words, deepcomm/agreement.py): ranks that disagree about
        the shape, or one that rejected its call (``reject``), raise ValueError on every rank instead of
        laying out their buffers differently."""
        key = (num_experts, max_tokens, hidden)
        if self.buffer is None or self.buffer.key != key:
            self.joined += 1  # the exchanges below are this call's first
            if self.buffer is None and self.meet is not None:  # where peers in normal-mode calls meet it
                self.meet.first_low_latency_call(fingerprint, self.errors)
            if self.buffer is not None and fingerprint is not None:
                self._agree_on_new_shape(fingerprint)
            self.close()
            if fingerprint is not None:
                self._agree_on_host(fingerprint)
            with torch.cuda.device(self.device):
                self.buffer = LlBuffer(self.C, self.group, self.rank, self.world_size, self.device, num_experts,
                                       max_tokens, hidden, self.record.err_dev, self.record.timeout_ns, self.memory,
                                       getattr(self.record, "agree_dev", 0))
                if self.record.masked:
                    self.buffer.write_mask(self.record.masked)
                if self.meet is not None:
                    self.meet.link(self.buffer)
        return self.buffer

    def _enter(self, ll: LlBuffer, stream: int) -> None:
        """Before a low-latency call: the low-latency calls this rank owes after meeting a peer's normal-mode call
        (mode_meet.py), each a send half of the peer's kind that only publishes words (agree_reject), in the slot
        the peer used: the next dispatch's, or the slot of the combine's handle (the dispatch it names)."""
        if self.meet is None:
            return
        for words in self.meet.enter(True, self.errors):
            if ll.put_peers:
                continue
            if words[agreement.Word.OP] == agreement.Op.LOW_LATENCY_DISPATCH:
                kind, slot = 0, ll.calls & 1
                ll.calls += 1
                self._note_slot(words, slot)
            else:
                kind = 1
                slot = self._slot_of_call.get(words[agreement.Word.HANDLE], (ll.calls - 1) & 1)
            ll.ctx.agree_reject(tuple(words), kind, slot, stream)

    def _note_slot(self, fingerprint, slot: int) -> None:
        if fingerprint is not None:
            if len(self._slot_of_call) >= 8:
                self._slot_of_call.pop(next(iter(self._slot_of_call)))
            self._slot_of_call[fingerprint[agreement.Word.CALL]] = slot

    def _agree_on_new_shape(self, fingerprint) -> None:
        """Before a call of another shape remakes the buffer: the call's words through the current buffer, as a
        send half of its kind that moves nothing and then compares, and a wait for it. Over NVLink one launch does
        both (agree_reject with ``compare``). With peers reached by puts the words reach them as a rejected call's
        do (reject: the words-only send half, then the puts), and a launch of its own after the puts compares
        (agree_compare): inside the send half's launch, ranks that all changed the shape would each wait for
        words that no rank has put yet. Ranks that keep the old shape meet the words in their own call and stop
        it, raising at their next look; this rank raises the same ValueError here and keeps the buffer. When every
        rank changed the shape the words agree and the buffer is remade on every rank."""
        ll = self.buffer
        # what earlier calls left in the record first (a timeout raises; an input error stays pending), so that the
        # record read below holds this exchange's own difference or nothing
        torch.cuda.synchronize(self.device)
        self.errors.check(low_latency=True)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        words = tuple(fingerprint)
        if fingerprint[agreement.Word.OP] == agreement.Op.LOW_LATENCY_DISPATCH:
            kind, slot = 0, ll.calls & 1
            ll.calls += 1
        else:
            kind, slot = 1, (ll.calls - 1) & 1
        if ll.put_peers:
            ll.ctx.agree_reject(words, kind, slot, stream, blocks=self.blocks)
            self._put_words(ll, kind, slot, stream)
            ll.ctx.agree_compare(words, kind, slot, stream)
        else:
            ll.ctx.agree_reject(words, kind, slot, stream, compare=True)
        # the whole device, as ModeMeet.first_low_latency_call does: a synchronize of the default stream under MPS
        # was seen to return before such an exchange had written the record
        torch.cuda.synchronize(self.device)
        err = self.record.check_error(low_latency=True, defer_input=True)
        if err is not None:
            self.errors.raise_difference(err)

    def _agree_on_host(self, fingerprint) -> None:
        """Every rank's words in one host exchange (only where a low-latency buffer is made), bounded by the
        Buffer's timeout (host_words.py); ValueError on every rank when they differ (agreement.check: the same text
        everywhere)."""
        try:
            rows = self.host_words.gather(fingerprint, self.record.timeout_ns / 1e9)
        except CommTimeoutError as e:
            self.record.broken, self.record.broken_peer = True, e.peer  # the ranks' exchanges are out of step now
            raise
        agreement.check(rows)

    def reject(self, fingerprint, handle=None) -> None:
        """A low-latency call this rank rejected: the send half of its kind, with only ``fingerprint`` (REJECTED
        set), so every peer's call stops on the words, naming this rank; over NVLink it then waits for the peers'
        words (a device synchronize, not while a CUDA graph is captured). Before the first
        low-latency call the peers are making the buffer: this rank joins that exchange instead. A rejected
        combine joins the slot of ``handle`` (the call's handle argument: the peers' combines of it use that
        slot), or the latest dispatch's where the handle is not a low-latency handle with a slot."""
        if self.buffer is None:
            try:
                # the peers making the buffer exchange words through the NVLink agree slots first, where that runs
                if self.meet is None or not self.meet.first_low_latency_call(fingerprint, self.errors, rejected=True):
                    self._agree_on_host(fingerprint)
            except (RuntimeError, ValueError):
                pass  # this rank's rejection, or a timeout (the next call says so): the caller raises its own error
            return
        ll = self.buffer
        # Over NVLink the words are also compared, and waited for: a peer met in a normal-mode call instead (its
        # words in our NVLink agree slots, mode_meet.py) leaves a record that says this rank owes normal mode that
        # call, which it pays at its next one; without the wait the modes' call numbers would stay out of step.
        compare = not ll.put_peers and self.meet is not None and not is_capturing()  # no host wait in a capture
        try:
            if compare:  # what earlier calls left in the record first, so that the record read below is ours
                torch.cuda.synchronize(self.device)
            self.errors.check(low_latency=True)
        except (RuntimeError, ValueError):
            return  # a timeout: nothing runs on this Buffer any more (the next call says so)
        # an input error already kept: a second one may still be in the record, which then holds no difference of
        # this exchange (the first record wins) and must not be read away here; so no comparison this time
        compare = compare and self.errors.pending is None
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._enter(ll, stream)
        if fingerprint[agreement.Word.OP] == agreement.Op.LOW_LATENCY_DISPATCH:
            kind, slot = 0, ll.calls & 1
            ll.calls += 1
            self._note_slot(fingerprint, slot)
        else:
            kind, slot = 1, _slot_of(handle, (ll.calls - 1) & 1)
        ll.ctx.agree_reject(tuple(fingerprint), kind, slot, stream, compare=compare, blocks=self.blocks)
        if compare:
            # the whole device (a raw-stream synchronize under MPS returned early: ModeMeet.first_low_latency_call);
            # the difference found (this rank's own rejection, and a peer in another mode's call) is noted and
            # dropped: the caller raises this rank's own error
            torch.cuda.synchronize(self.device)
            try:
                self.record.check_error(low_latency=True, defer_input=True)
            except (RuntimeError, ValueError):
                pass  # a timeout: the next call says so
        if ll.put_peers:
            self._put_words(ll, kind, slot, stream)

    def _put_words(self, ll: LlBuffer, kind: int, slot: int, stream: int) -> None:
        """After a words-only send half of ``kind`` into ``slot`` (agree_reject): the words (and a dispatch's
        arrival words) to the live put peers as a send half's would go: a dispatch's in its data and flags puts, a
        combine's with the weights, which the peers' send halves wait for."""
        if kind == 0:
            ll.put(0, slot, stream, self.record.masked)
        else:
            ll.put_weights(slot, stream, self.record.masked)

    def _launch(self, launch, return_recv_hook: bool, stream: int, keep=(), after_send=None):
        """Without a hook: ``launch(SEND | RECV, stream)``, both halves in one kernel. With a hook: the send half
        now, and a hook that launches the receive half once, on the stream current when it is called, so no SM
        waits in between. When that is another stream, an event recorded after the send orders the receive after
        it (its call number is the one the send leaves behind). ``keep``: the caller's tensors the receive half
        reads; the hook holds them until it has launched and marks them in use on its stream. ``after_send``:
        ``after_send(stream)`` runs right after the send half (the puts to peers reached by NVSHMEM puts); then the
        halves are always two launches, the receive half at once when there is no hook. An input error an earlier
        call left is raised once the receive half is launched: here without a hook, else by the hook. Returns the
        hook."""
        phases = self.C.LL_PHASES  # enum LlPhases (csrc/kernels/ll_phases.hpp)
        self.joined += 1
        # A launch or a put that fails here may leave the peers waiting for what this rank never sent: the Buffer
        # then takes no more calls (DeviceErrorRecord.set_broken_by), its next one would meet theirs out of step.
        try:
            if not return_recv_hook and after_send is None:
                launch(phases["both"], stream)
            else:
                launch(phases["send"], stream)
                if after_send is not None:
                    after_send(stream)
                if not return_recv_hook:
                    launch(phases["recv"], stream)
        except Exception as e:
            self.record.set_broken_by("low-latency call", e)
            raise
        if not return_recv_hook:
            self.errors.raise_pending()
            return _noop
        sent = torch.cuda.Event()
        sent.record(torch.cuda.current_stream(self.device))
        held = [keep]

        def hook() -> None:
            if not held:
                return
            tensors = held.pop()
            self.errors.check(low_latency=True)
            current = torch.cuda.current_stream(self.device)
            if current.cuda_stream != stream:
                current.wait_event(sent)
            try:
                launch(phases["recv"], current.cuda_stream)
            except Exception as e:
                self.record.set_broken_by("low-latency receive hook", e)
                raise
            if current.cuda_stream != stream:
                for t in tensors:
                    t.record_stream(current)
            self.errors.raise_pending()
        return hook

    def _puts(self, ll: LlBuffer, kind: int, slot: int):
        """The after_send of a call with peers reached by puts (LlBuffer.put), else None."""
        if not ll.put_peers:
            return None
        return lambda stream: ll.put(kind, slot, stream, self.record.masked)

    def dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, use_ue8m0,
                 return_recv_hook, fingerprint=None):
        # Runs on the caller's stream with no host sync (so it can be captured in a CUDA graph): expert ids are
        # checked by the kernel, and a bad id raises ValueError at the next look at the error record.
        T, H = x.shape
        K, M = topk_idx.shape[1], num_max_dispatch_tokens_per_rank
        ll = self._buffer_for(num_experts, M, H, fingerprint)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._enter(ll, stream)
        self.errors.check(low_latency=True)
        words = words_or_none(fingerprint)
        slot = ll.calls & 1
        ll.calls += 1
        self._note_slot(fingerprint, slot)
        blocks = self.blocks
        x_ptr, idx_ptr = x.data_ptr(), topk_idx.data_ptr()
        hook = self._launch(lambda phases, s: ll.ctx.dispatch(phases, blocks, x_ptr, idx_ptr, T, K, slot, use_fp8,
                                                                 use_ue8m0, s, words), return_recv_hook, stream,
                            after_send=self._puts(ll, 0, slot))
        recv_x, recv_count, layout, src_info = ll.outputs(slot, use_fp8)
        handle = LowLatencyHandle(src_info=src_info, layout=layout, recv_pos=ll.recv_pos(slot, T, K),
                                  num_experts=num_experts, num_max_dispatch_tokens_per_rank=M, hidden=H,
                                  buffer_id=-1, slot=slot)
        return recv_x, recv_count, handle, hook

    def combine(self, x, topk_idx, topk_weights, handle, return_recv_hook, use_fp8=False, fingerprint=None):
        T, K = topk_idx.shape
        H = x.shape[2]
        ll = self._buffer_for(handle.num_experts, handle.num_max_dispatch_tokens_per_rank, handle.hidden,
                              fingerprint)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._enter(ll, stream)
        self.errors.check(low_latency=True)
        words = words_or_none(fingerprint)
        out = torch.empty(T, H, dtype=torch.bfloat16, device=self.device)
        blocks, slot = self.blocks, handle.slot
        ptrs = (x.data_ptr(), topk_weights.data_ptr(), topk_idx.data_ptr(), out.data_ptr())
        if ll.put_peers:
            # the send half waits for every source's weights: put peers get ours first (a weights-only launch)
            self.joined += 1
            ll.ctx.combine(self.C.LL_PHASES["weights"], blocks, *ptrs, T, K, slot, use_fp8, stream, words)
            ll.put_weights(slot, stream, self.record.masked)
        # the receive half reads x (our own tokens' partial), topk_idx and topk_weights, and writes out
        hook = self._launch(lambda phases, s: ll.ctx.combine(phases, blocks, *ptrs, T, K, slot, use_fp8, s, words),
                            return_recv_hook, stream, keep=(x, topk_idx, topk_weights, out),
                            after_send=self._puts(ll, 1, slot))
        return out, hook

    @property
    def masked(self) -> frozenset:
        return self.record.masked

    def mask_ranks(self, ranks: frozenset) -> None:
        """Leave ``ranks`` out of low-latency mode from the next call on (no collective: survivors of a lost peer
        call it on their own)."""
        masked = self.record.masked | ranks
        self.record.set_masked(masked)
        if self.buffer is not None:
            self.buffer.write_mask(masked)

    def unmask_ranks(self) -> None:
        """Every rank again; collective (every rank calls it, with no low-latency call in flight): the kernels'
        call numbers and counters restart from zero everywhere, since masked ranks missed calls."""
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        if self.buffer is not None:
            self.buffer.reset_signals()
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self.record.set_masked(frozenset())
