"""Stand-ins for the CUDA side of the NVLink backend's normal mode, so that its host path (deepcomm/nvlink/backend.py)
runs on a CPU box: a recording NvlContext (FakeCtx), arena views over host memory, events and streams as ints.
tests/normal/test_cuda_host_path.py checks the host path with them; dev/profile_host_cpu.py times it."""
import contextlib
import types

import torch

from deepcomm._ext import load_extension
from deepcomm.cuda.mode_meet import ModeMeet

C = load_extension()
if C is not None:
    from deepcomm.config import Config
    from deepcomm.nvlink import backend as B
    from deepcomm.nvlink.arena_sizing import arena_sizes
    from deepcomm.nvlink.dispatch_call import OutputTypes
    from deepcomm.cuda.arena import Arena
    from deepcomm.cuda.arg_reader import dispatch_arg_reader
    from deepcomm.cuda.call_errors import CallErrors
    from deepcomm.cuda.error_record import DeviceErrorRecord
    B._load_flags(C)

CALLER, OTHER, COMM, CAPTURE = 11, 22, 33, 44
DEFAULT = 0  # the legacy default stream, torch's default stream
POOL = 55    # what torch.cuda.ExternalStream(0) gives: a fresh pool stream, ordered with nothing above
LAYOUT_KEYS = ("x", "scales", "topk_idx", "topk_weights", "src_idx", "total")


class FakeCtx:
    """Records each dispatch_call / dispatch_into / combine_call and answers as the C++ side would for rows
    arriving ``recv`` (the rank's own token count when None) with ``status``."""

    def __init__(self):
        self.calls, self.combines = [], []
        self.status, self.recv, self.bad_mine = 0, None, 0

    def dispatch_call(self, flags, wait, run, prev, start, end, topk_idx, T, K, E, in_rank, send_pos, notify_out,
                      tag, x, x_row_bytes, scales, scale_row_bytes, weights, count_matrix, invalid, out_block,
                      out_rows, num_blocks, alignment, src_copy, timeout_s, fingerprint):
        self.calls.append(dict(flags=flags, wait=wait, run=run, prev=prev, end=end, tag=tag, out_block=out_block,
                               out_rows=out_rows, invalid=invalid, alignment=alignment, src_copy=src_copy,
                               fingerprint=fingerprint, in_rank=in_rank, send_pos=send_pos, notify_out=notify_out))
        waited = flags & B.WAIT
        n = out_rows if out_rows >= 0 else (T if self.recv is None else self.recv) if waited else -1
        if waited and self.status:
            return (self.status, -1, 1, self.bad_mine, [], (0,) * 6, 1.0)
        lay = C.dispatch_out_layout(n, x_row_bytes, scale_row_bytes, K) if n >= 0 else None
        per_expert = [-(-n // alignment) * alignment] + [0] * (E - 1) if waited else []
        return (0, n, 0, 0, per_expert, tuple(lay[k] for k in LAYOUT_KEYS) if lay else (0,) * 6, 2.0)

    def dispatch_into(self, arena, arena_at, reserve_rows, x_type, scale_type, with_idx, with_weights, flags, wait,
                      run, prev, start, end,
                      topk_idx, T, K, E, in_rank, send_pos, notify_out, tag, x, x_row_bytes, scales, scale_row_bytes,
                      weights, count_matrix, invalid, out_rows, num_blocks, alignment, src_copy, timeout_s,
                      fingerprint):
        """dispatch_call into an arena block through the binding's own arena side (ArenaCore.into_block): None
        without a block of ``reserve_rows`` rows; the block given back on bad counts, trimmed to the rows after a
        wait, its views made by the arena's core."""
        def launch(offset):
            res = self.dispatch_call(flags, wait, run, prev, start, end, topk_idx, T, K, E, in_rank, send_pos,
                                     notify_out, tag, x, x_row_bytes, scales, scale_row_bytes, weights, count_matrix,
                                     invalid, arena_at + offset, out_rows, num_blocks, alignment, src_copy, timeout_s,
                                     fingerprint)
            self.calls[-1]["reserve_rows"] = reserve_rows
            return res[0], res[1], res[5][5], res

        need = C.dispatch_out_layout(reserve_rows, x_row_bytes, scale_row_bytes, K)["total"]
        got = arena.into_block(need, bool(flags & B.WAIT), x_type, x_row_bytes, scale_type, scale_row_bytes, K,
                               with_idx, with_weights, launch)
        if got is None:
            return None
        res, views = got
        return res[:5] + (views,) + res[6:]

    def combine_call(self, flags, wait, run, prev, start, end, *rest):
        self.combines.append(dict(flags=flags, wait=wait, run=run, prev=prev, end=end))


class Patches:
    """monkeypatch.setattr's shape outside pytest (the dev/ tools' runs of the stand-ins): undo() puts back every
    attribute set, newest first."""

    def __init__(self):
        self.saved = []

    def setattr(self, obj, name, value, raising=True):
        self.saved.append((obj, name, getattr(obj, name, None)))
        setattr(obj, name, value)

    def undo(self):
        for obj, name, old in reversed(self.saved):
            setattr(obj, name, old)
        self.saved.clear()


class FakeEvent:
    def __init__(self, handle):
        self.cuda_event, self.recorded, self.streams = handle, 0, []

    def record(self, stream=None):
        self.recorded += 1
        self.streams.append(stream)


def cpu_backend(setattr_):
    """A CudaBackend of world size 1 (1024 hidden, 256 tokens) whose CUDA side is the stand-ins above; ``setattr_``
    (monkeypatch.setattr, or any (obj, name, value[, raising]) setter that undoes itself) patches torch's stream
    calls and the backend's stream queries. The arena and its bounce area are host memory, its views the C++
    core's (deepcomm/cuda/arena.py) as on the device. Returns a namespace: ``b`` (the backend), ``ctx``
    (its FakeCtx), and ``stream`` / ``capturing`` (what the backend sees as the caller's stream and the capture
    state: set them to steer it)."""
    monkeypatch = types.SimpleNamespace(setattr=setattr_)
    state = types.SimpleNamespace(stream=CALLER, capturing=False, waited_streams=[], entered=[])
    monkeypatch.setattr(B, "_current_stream", lambda index: state.stream)
    monkeypatch.setattr(B, "is_capturing", lambda: state.capturing)
    # streams are their raw handles, as torch makes them: ExternalStream(0) is a new pool stream, not the default one
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda ptr, device=None: ptr if ptr else POOL)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: DEFAULT)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: state.entered.append(s) or contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: CALLER)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None, raising=False)
    b = B.CudaBackend.__new__(B.CudaBackend)
    b.C, b.rank, b.world_size, b.device, b._device_index = C, 0, 1, torch.device("cpu"), 0
    b.config = Config(num_sms=24, timeout_s=5, max_tokens_per_rank=256, hidden=1024)
    arena_bytes, worst = arena_sizes(C, 1, 256, 1024)
    state.memory = torch.zeros(arena_bytes + worst, dtype=torch.uint8)  # the arena, then the bounce area
    b.arena = Arena(state.memory.data_ptr(), arena_bytes, None)
    b.nvl = types.SimpleNamespace(ctx=FakeCtx(), layout={"arena": 4096}, broken=False, broken_peer=None,
                                  broken_reason=None, check_error=lambda **kw: None, owed=[])
    b.nvl.set_broken_by = lambda call, error: DeviceErrorRecord.set_broken_by(b.nvl, call, error)
    b.bounce_offset, b.bounce_bytes = arena_bytes, worst
    b.comm_stream = types.SimpleNamespace(cuda_stream=COMM, wait_stream=state.waited_streams.append)
    b._events = [FakeEvent(100 + i) for i in range(B.EVENT_RING)]
    b._event_handles = [e.cuda_event for e in b._events]
    b._start_event, b._start_handle = FakeEvent(99), 99
    b._event_i, b._event, b._last_stream, b._last_end, b._last_captured = 0, None, None, 0, False
    b._releases_seen, b._bounce_pending, b._tag, b._joined = 0, False, 0, 0
    b.ll = types.SimpleNamespace(joined=0)  # no low-latency engine: its count of joined calls only
    b.errors = CallErrors(b.nvl)
    b.meet = ModeMeet(b.nvl, b.device, normal_exchange=b._exchange_words)
    b._capacity_rows, b.last_wait_us = 256, 0.0
    b.last_placement, b.placements = None, dict.fromkeys(B.PLACEMENTS, 0)
    b._full_copies = False  # DEEPCOMM_ARENA_FULL=place, the default
    b._types, b._arena_at = OutputTypes(b.arena), b.nvl.layout["arena"]
    b._work_cache, b._work_pool = {}, B.WorkPool(b.device)
    b._wait_timeout_s = 8.5
    # the plain calls' C++ argument reader over CPU tensors, asking the stand-in's stream (never captured)
    b.arg_reader = dispatch_arg_reader(C, 1, -1, 1024, 256, lambda index: state.stream)
    state.b, state.ctx = b, b.nvl.ctx
    return state


def put_behind_buffer(buf, b) -> None:
    """Make the stand-in backend ``b`` the backend of ``buf`` (a Buffer of world size 1 made on the reference
    backend, whose own backend is destroyed): the Buffer layer's checks, fingerprint, numbering and plain calls'
    argument reader in front of the stand-in."""
    buf._backend.destroy()
    buf._backend, buf._takes_fingerprints, buf._counts_joined = b, True, True
    buf._x_dtypes = b.capabilities.x_dtypes
    buf._arg_reader = b.arg_reader
    if b.arg_reader is not None:
        b.arg_reader.set_num_sms(buf.config.num_sms)  # as Buffer does when it takes the reader
