"""A rank's low-latency buffer (csrc/runtime/ll_layout.hpp): made at the first low-latency call of a shape,
mapped into every rank, sharing the NVLink buffer's error record and timeout. Its memory is a CUDA IPC allocation
(``memory="ipc"``) or a block of NVSHMEM's symmetric heap (``"nvshmem"``); the kernels see peer pointers either way.

With NVSHMEM memory, a peer that ``nvshmem_ptr`` cannot map (another node without a shared NVLink domain; or every
peer with ``DEEPCOMM_LL_FORCE_PUTS=1``, to prove the path on one host) is a **put peer**: the buffer gets an outbox
(ll_layout.hpp), the kernels' base for that peer points into it, so everything a send half writes for the peer
lands in our own outbox block for it, and ``put(kind, slot, stream)`` then sends that block's data section, a
quiet, its flags section and a quiet with NVSHMEM's stream-ordered puts into the peer's inbox for us. Calls with
put peers always launch the send and receive halves apart (the puts go in between); a combine first launches a
weights-only phase and puts the weights (``put_weights``), because its send half waits for every source's weights.

``DEEPCOMM_LL_PDL`` (pdl_mode) launches the kernels with programmatic dependent launch; read when the buffer is
made.

Everything a dispatch returns (recv_x, recv_count and the handle's tensors) is a view of this buffer, made once
per slot and handed out again on every call: valid until the same slot is used again two dispatches later."""
from __future__ import annotations

import os
from typing import Dict, Tuple

import torch
import torch.distributed as dist

from .arena import as_device_bytes
from .nvshmem_memory import NvshmemMemory
from .peer_memory import PeerMemory

MEMORY = {"ipc": PeerMemory, "nvshmem": NvshmemMemory}  # deepcomm.config.LL_MEMORY_KINDS
FORCE_PUTS_ENV = "DEEPCOMM_LL_FORCE_PUTS"
PDL_ENV = "DEEPCOMM_LL_PDL"
PDL_DEFAULT = 2  # measured on 2 x H200: 2 is a little faster than 0; 1 slows dispatch + combine pairs (tuning.md)


def pdl_mode() -> int:
    """DEEPCOMM_LL_PDL: 0 plain launches, 1 programmatic dependent launch with an early trigger (the next low-latency
    kernel's blocks get onto the SMs while this one runs), 2 programmatic dependent launch without it
    (csrc/kernels/ll_common.cuh ll_gate)."""
    value = os.environ.get(PDL_ENV, "").strip()
    if value == "":
        return PDL_DEFAULT
    if value not in ("0", "1", "2"):
        raise ValueError(f"{PDL_ENV}: expected 0, 1 or 2, got {value!r}")
    return int(value)


def force_puts(memory: str) -> bool:
    """``DEEPCOMM_LL_FORCE_PUTS=1``: reach every peer by puts, even one NVLink could map (NVSHMEM memory only)."""
    value = os.environ.get(FORCE_PUTS_ENV, "").strip()
    if value in ("", "0"):
        return False
    if value != "1":
        raise ValueError(f"{FORCE_PUTS_ENV}: expected 1 or 0, got {value!r}")
    if memory != "nvshmem":
        raise ValueError(f"{FORCE_PUTS_ENV}=1 needs the low-latency buffer in NVSHMEM memory "
                         "(DEEPCOMM_LL_MEMORY=nvshmem or low_latency_memory='nvshmem')")
    return True


class LlBuffer:
    def __init__(self, C, group, rank: int, world_size: int, device: torch.device, num_experts: int,
                 max_tokens: int, hidden: int, err_dev: int, timeout_ns: int, memory: str = "ipc",
                 agree_dev: int = 0):
        self.key = (num_experts, max_tokens, hidden)
        self.rank = rank
        forced = force_puts(memory)
        kw = {"allow_unreachable": True} if memory == "nvshmem" else {}
        with_outbox = None
        if memory == "nvshmem":
            # a heap that also holds the outbox, should a peer turn out to need puts (sized once per process)
            from . import nvshmem_session
            with_outbox = C.LlContext(rank, world_size, num_experts, max_tokens, hidden, C.TOPK_MAX, True)
            nvshmem_session.session_for(group, heap_bytes=with_outbox.layout()["total"])
        self.ctx = with_outbox if forced else C.LlContext(rank, world_size, num_experts, max_tokens, hidden,
                                                          C.TOPK_MAX, False)
        self.layout = self.ctx.layout()
        self.memory = MEMORY[memory](C, group, rank, world_size, self.layout["total"], **kw)
        if memory == "nvshmem" and not forced:
            # a peer NVSHMEM cannot map: every rank remakes its block with an outbox (collective decision)
            unmapped = [None] * world_size
            dist.all_gather_object(unmapped, any(p == 0 for p in self.memory.peer_ptrs), group=group)
            if any(unmapped):
                self.memory.close()
                self.ctx = with_outbox
                self.layout = self.ctx.layout()
                self.memory = MEMORY[memory](C, group, rank, world_size, self.layout["total"], **kw)
        lay = self.layout
        self.put_peers = [r for r, p in enumerate(self.memory.peer_ptrs)
                          if r != rank and (forced or p == 0)]
        for r, p in enumerate(self.memory.peer_ptrs):
            if r in self.put_peers:
                # stores meant for r at inbox_at(slot, rank) + f land at outbox_at(slot, r) + f, for either slot
                p = self.memory.ptr + lay["outbox"] - lay["inbox"] + (r - rank) * lay["block"]
            self.ctx.set_peer(r, p)
        # past LL_INLINE_PEERS ranks the kernels read the far peers' bases from device memory (csrc/kernels/api.hpp)
        self.peer_table = None
        if world_size > C.LL_INLINE_PEERS:
            self.peer_table = torch.tensor(self.ctx.peer_bases(), dtype=torch.int64, device=device)
            self.ctx.set_peer_table(self.peer_table.data_ptr())
        self.ctx.set_pdl(pdl_mode())
        self.ctx.set_error_record(err_dev)
        self.ctx.set_agree_record(agree_dev)  # shared with the NVLink buffer (deepcomm/cuda/agree_record.py)
        self.ctx.set_timeout_ns(timeout_ns)
        self.bytes = as_device_bytes(self.memory.ptr, self.layout["total"], device)
        # diagnostics: per-block timer stamps of the latest call (csrc/kernels/ll_common.cuh, LlTracePoint)
        self.trace = None
        if os.environ.get("DEEPCOMM_LL_TRACE") == "1":
            self.trace = torch.zeros(C.MAX_BLOCKS, C.LL_TRACE_POINTS, dtype=torch.int64, device=device)
            self.ctx.set_trace(self.trace.data_ptr())
        self.calls = 0
        self.world_size = world_size
        L, R, M, H = num_experts // world_size, world_size, max_tokens, hidden
        self._recv_pos: Dict[Tuple[int, int, int], torch.Tensor] = {}
        self._slots = []
        for slot in range(2):
            x0 = self.layout["recv_x_slot"][slot]
            s0 = self.layout["recv_scales_slot"][slot]
            bf16 = self._view(x0, L * R * M * H * 2, torch.bfloat16).view(L, R * M, H)
            fp8 = (self._view(x0, L * R * M * H, torch.float8_e4m3fn).view(L, R * M, H),
                   self._view(s0, L * R * M * (H // 128) * 4, torch.float32).view(L, R * M, H // 128))
            self._slots.append(dict(
                bf16=bf16, fp8=fp8,
                count=self._view(self.layout["out_count_slot"][slot], L * 4, torch.int32),
                layout=self._view(self.layout["out_layout_slot"][slot], L * R * 8, torch.int32).view(L, R, 2),
                src_info=self._view(self.layout["out_src_info_slot"][slot], L * R * M * 4, torch.int32).view(L, R * M),
            ))

    def _view(self, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return self.bytes[offset:offset + nbytes].view(dtype)

    def outputs(self, slot: int, use_fp8: bool):
        """``(recv_x, recv_count, layout, src_info)`` of one slot."""
        s = self._slots[slot]
        return (s["fp8"] if use_fp8 else s["bf16"]), s["count"], s["layout"], s["src_info"]

    def recv_pos(self, slot: int, num_tokens: int, topk: int) -> torch.Tensor:
        key = (slot, num_tokens, topk)
        view = self._recv_pos.get(key)
        if view is None:
            view = self._view(self.layout["out_recv_pos_slot"][slot], num_tokens * topk * 4,
                              torch.int32).view(num_tokens, topk)
            self._recv_pos[key] = view
        return view

    def write_mask(self, masked) -> None:
        """Ranks the kernels leave out (csrc/runtime/ll_layout.hpp "mask"), on the current stream."""
        flags = [1 if r in masked else 0 for r in range(self.world_size)]
        self._view(self.layout["mask"], 4 * self.world_size, torch.int32).copy_(
            torch.tensor(flags, dtype=torch.int32), non_blocking=False)

    def put(self, kind: int, slot: int, stream: int, masked=frozenset()) -> None:
        """After a send half of ``kind`` (0 dispatch, 1 combine) into ``slot``, on ``stream``: for every live put
        peer d, our outbox block for d goes into d's inbox for us: the data section (everything but the arrival
        words), a quiet, then the flags section (the per-block arrival words, csrc/runtime/ll_layout.hpp), so a
        receiver that sees an arrival word sees the data; then another quiet, so nothing of the call lands after
        anything later on the stream. The receive half waits for the arrival words as it does for stores over
        NVLink."""
        peers = [d for d in self.put_peers if d not in masked]
        if not peers:
            return
        from . import nvshmem_session
        n = nvshmem_session.load_library()
        for section in ("data", "flags"):
            begin, end = self.layout[section][kind]
            self._put_section(n, slot, peers, begin, end, kind, stream)
            # data before flags; and the flags delivered before anything later on the stream (a reset of the
            # signals, a free of the buffer, the next call's puts into the same slot)
            n.quiet_on_stream(stream)

    def put_weights(self, slot: int, stream: int, masked=frozenset()) -> None:
        """Before a combine's send half, after its weights-only launch: our tagged weights to every live put peer,
        whose send half polls them (each carries its call's tag, so no order and no quiet are needed here; the
        data put after the send half carries the same words again, and its quiet covers this put too)."""
        peers = [d for d in self.put_peers if d not in masked]
        if peers:
            from . import nvshmem_session
            self._put_section(nvshmem_session.load_library(), slot, peers, self.layout["ib"]["weights"],
                              self.layout["ib"]["partials"], 1, stream)

    def _put_section(self, n, slot: int, peers, begin: int, end: int, kind: int, stream: int) -> None:
        """With the NVSHMEM library ``n``: bytes [begin, end) of our outbox block for each of ``peers`` into its
        inbox for us (the same offset in its symmetric block), signalling its put_seq word of ``kind``."""
        lay, base = self.layout, self.memory.ptr
        mine = lay["inbox"] + (slot * self.world_size + self.rank) * lay["block"]  # d's inbox for us: same offset
        signal = base + mine + lay["put_seq"] + 8 * kind
        for d in peers:
            outbox = lay["outbox"] + (slot * self.world_size + d) * lay["block"]
            n.putmem_signal_on_stream(base + mine + begin, base + outbox + begin, end - begin, signal, 1,
                                      n.SIGNAL_ADD, d, stream)

    def reset_signals(self) -> None:
        """Zero the call numbers, counters and flags (and the mask): every rank at once, with no kernel running."""
        self.bytes[:self.layout["signal_bytes"]].zero_()
        self.calls = 0

    def close(self) -> None:
        self._slots = []
        self._recv_pos.clear()
        self.bytes = None
        self.memory.close()
