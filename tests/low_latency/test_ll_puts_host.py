"""The low-latency puts path on the host, with no GPU (deepcomm/cuda/ll_buffer.py, ll_calls.py): LlBuffer.put
issues, per live put peer, the data section of our outbox block for it into its inbox for us, a quiet, then the
flags section (the arrival words) and a quiet; put_weights the tagged weights alone. Replayed on byte arrays, the
kernels' stores through the put-peer base followed by those puts leave every peer's inbox as direct stores would.
With no put peer a call is still one fused launch, as on main."""
import types

import numpy as np
import pytest
import torch

from deepcomm._ext import load_extension

C = load_extension()
pytestmark = pytest.mark.skipif(C is None, reason="deepcomm._C is not built (no nvcc at install time)")
TOPK_MAX = getattr(C, "TOPK_MAX", 0)  # top-k slots the kernels take (csrc/kernels/topk_max.hpp)
FIELDS = ["counts", "ntok", "meta", "input_err", "agree_dispatch", "stage_x", "stage_scales", "weights",
          "agree_combine", "partials", "arrivals_dispatch", "arrivals_combine"]


class FakeNvshmem:
    """Records the stream-ordered calls LlBuffer makes, and performs the puts on byte arrays (one per PE)."""
    SIGNAL_SET, SIGNAL_ADD = 9, 10

    def __init__(self, heaps, base):
        self.heaps, self.base, self.calls = heaps, base, []

    def putmem_signal_on_stream(self, dest, source, nbytes, sig_addr, signal, sig_op, pe, stream):
        self.calls.append(("put", dest - self.base, source - self.base, nbytes, pe))
        d, s = dest - self.base, source - self.base
        self.heaps[pe][d:d + nbytes] = self.heaps[self.me][s:s + nbytes]

    def quiet_on_stream(self, stream):
        self.calls.append(("quiet",))


def _buffer(lay, rank, world, put_peers, base):
    from deepcomm.cuda.ll_buffer import LlBuffer
    ll = object.__new__(LlBuffer)
    ll.layout, ll.rank, ll.world_size, ll.put_peers = lay, rank, world, put_peers
    ll.memory = types.SimpleNamespace(ptr=base)
    return ll


@pytest.mark.parametrize("world", [2, 4])
def test_put_sends_data_then_flags_of_our_outbox_into_the_peers_inbox(world, monkeypatch):
    from deepcomm.cuda import nvshmem_session
    rank, base = 1, 1 << 40
    lay = C.LlContext(rank, world, 16, 4, 256, TOPK_MAX, True).layout()
    heaps = [np.zeros(lay["total"], dtype=np.uint8) for _ in range(world)]
    fake = FakeNvshmem(heaps, base)
    fake.me = rank
    monkeypatch.setattr(nvshmem_session, "load_library", lambda: fake)
    peers = [d for d in range(world) if d != rank]
    masked = frozenset({peers[-1]}) if world > 2 else frozenset()
    ll = _buffer(lay, rank, world, peers, base)
    block = lay["block"]
    for kind in (0, 1):
        for slot in (0, 1):
            fake.calls.clear()
            ll.put(kind, slot, 7, masked)
            live = [d for d in peers if d not in masked]
            (db, de), (fb, fe) = lay["data"][kind], lay["flags"][kind]
            inbox = lay["inbox"] + (slot * world + rank) * block
            want = []
            for begin, end in ((db, de), (fb, fe)):
                for d in live:
                    outbox = lay["outbox"] + (slot * world + d) * block
                    want.append(("put", inbox + begin, outbox + begin, end - begin, d))
                want.append(("quiet",))
            assert fake.calls == want
    fake.calls.clear()
    ll.put_weights(1, 7, masked)
    ib = lay["ib"]
    inbox = lay["inbox"] + (world + rank) * block
    assert fake.calls == [("put", inbox + ib["weights"], lay["outbox"] + (world + d) * block + ib["weights"],
                           ib["partials"] - ib["weights"], d) for d in peers if d not in masked]


def test_no_put_peers_no_calls(monkeypatch):
    from deepcomm.cuda import nvshmem_session
    monkeypatch.setattr(nvshmem_session, "load_library", lambda: pytest.fail("NVSHMEM used with no put peers"))
    lay = C.LlContext(0, 2, 16, 4, 256, TOPK_MAX).layout()
    ll = _buffer(lay, 0, 2, [], 1 << 40)
    ll.put(0, 0, 7)
    ll.put_weights(0, 7)


@pytest.mark.parametrize("world", [2, 3])
def test_stores_through_the_outbox_then_puts_equal_direct_stores(world, monkeypatch):
    """Every rank 'stores' a distinct pattern into every field it writes at every peer (through the kernels'
    accessors and the put-peer base), then puts both kinds; each inbox must hold what direct stores would."""
    from deepcomm.cuda import nvshmem_session
    base = 1 << 40
    ctxs = [C.LlContext(r, world, 8, 2, 128, TOPK_MAX, True) for r in range(world)]
    lay = ctxs[0].layout()
    block = lay["block"]
    heaps = [np.zeros(lay["total"], dtype=np.uint8) for _ in range(world)]
    direct = [np.zeros(lay["total"], dtype=np.uint8) for _ in range(world)]
    fake = FakeNvshmem(heaps, base)
    monkeypatch.setattr(nvshmem_session, "load_library", lambda: fake)
    slot = 1
    for r in range(world):
        for d in range(world):
            # the kernels' base for d: ourselves, or our outbox block for d
            off = 0 if d == r else lay["outbox"] - lay["inbox"] + (d - r) * block
            dst = heaps[r] if d != r else heaps[d]
            for i, f in enumerate(FIELDS):
                for t in (0, 1):
                    at = ctxs[r].field_at(f, slot, r, t)
                    val = (r * 37 + d * 11 + i * 3 + t + 1) % 251
                    dst[off + at:off + at + 4] = val
                    direct[d][at:at + 4] = val
    for r in range(world):
        fake.me = r
        ll = _buffer(lay, r, world, [d for d in range(world) if d != r], base)
        for kind in (0, 1):
            ll.put(kind, slot, 0)
    for d in range(world):
        a, b = lay["inbox"], lay["inbox"] + 2 * world * block
        assert np.array_equal(heaps[d][a:b], direct[d][a:b]), d


def test_no_put_peers_one_fused_launch():
    """_launch without put peers and without a hook: one launch of both halves (main's path)."""
    from deepcomm.cuda.error_record import DeviceErrorRecord
    from deepcomm.cuda.ll_calls import LowLatencyEngine
    record = DeviceErrorRecord.__new__(DeviceErrorRecord)  # its state only: no mapped memory on a CPU box
    record.masked, record.broken, record.broken_peer = frozenset(), False, None
    errors = types.SimpleNamespace(raise_pending=lambda: None)
    calls = LowLatencyEngine(C, None, 0, 2, torch.device("cpu"), record, errors, "ipc", 4)
    phases = C.LL_PHASES
    ll = types.SimpleNamespace(put_peers=[])
    assert calls._puts(ll, 0, 0) is None
    launches = []
    calls._launch(lambda phases, s: launches.append(phases), False, 5, after_send=calls._puts(ll, 0, 0))
    assert launches == [phases["both"]]
    # with put peers: send, the puts, receive
    seen = []
    ll = types.SimpleNamespace(put_peers=[1], put=lambda kind, slot, stream, masked: seen.append(("put", kind)))
    calls._launch(lambda phases, s: seen.append(phases), False, 5, after_send=calls._puts(ll, 1, 0))
    assert seen == [phases["send"], ("put", 1), phases["recv"]]
    # each call's launch counts as its joined exchange before it is made (CudaBackend.joined_calls), even one
    # that fails inside
    assert calls.joined == 2

    assert not record.broken

    def failing(phases, s):
        raise RuntimeError("launch failed")
    with pytest.raises(RuntimeError, match="launch failed"):
        calls._launch(failing, False, 5)
    assert calls.joined == 3
    # the peers may wait for what this rank never sent: the Buffer takes no more calls, and says why
    assert record.broken and "low-latency call failed inside its crossing" in record.broken_reason
    with pytest.raises(RuntimeError, match="RuntimeError: launch failed"):
        record.check_error(low_latency=True)


def test_call_words_travel_inside_the_put_sections():
    """With put peers the call words sit in the inbox block: a dispatch's in its data section (compared once the
    arrival words, put after a quiet, are in), a combine's in the range put_weights sends ahead of the send half."""
    for world in (2, 5):
        ctx = C.LlContext(0, world, 8 * world, 4, 256, TOPK_MAX, True)
        lay, ib = ctx.layout(), ctx.layout()["ib"]
        words = 8 * C.FINGERPRINT_WORDS  # one tagged u64 per word
        (db, de), (cb, ce) = lay["data"]
        assert db <= ib["agree_dispatch"] and ib["agree_dispatch"] + words <= de
        assert ib["weights"] <= ib["agree_combine"] and ib["agree_combine"] + words <= ib["partials"]
        assert cb <= ib["agree_combine"] and ib["agree_combine"] + words <= ce
        for slot in (0, 1):
            for s_ in range(world):
                inbox = lay["inbox"] + (slot * world + s_) * lay["block"]
                assert ctx.field_at("agree_dispatch", slot, s_) == inbox + ib["agree_dispatch"]
                assert ctx.field_at("agree_combine", slot, s_) == inbox + ib["agree_combine"]


@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_a_rejected_call_reaches_put_peers(op, monkeypatch):
    """A call this rank rejected, on a buffer with put peers: the words-only send half (with the peers' block
    count, for a dispatch's arrival words), then the puts a send half of that kind makes: a dispatch's data and
    flags, a combine's weights range (the peers' send halves wait for its words)."""
    from deepcomm import agreement
    from deepcomm.cuda.ll_calls import LowLatencyEngine
    record = types.SimpleNamespace(masked=frozenset({3}))
    errors = types.SimpleNamespace(raise_pending=lambda: None, check=lambda low_latency=False: None)
    eng = LowLatencyEngine(C, None, 0, 4, torch.device("cpu"), record, errors, "ipc", 6)
    seen = []
    ctx = types.SimpleNamespace(agree_reject=lambda words, kind, slot, stream, compare=False, blocks=0: seen.append(
        ("reject", kind, slot, blocks) + (("compare",) if compare else ())))
    eng.buffer = types.SimpleNamespace(
        ctx=ctx, calls=3, put_peers=[1, 2, 3],
        put=lambda kind, slot, stream, masked: seen.append(("put", kind, slot, masked)),
        put_weights=lambda slot, stream, masked: seen.append(("put_weights", slot, masked)))
    eng._enter = lambda ll, stream: None
    eng.device = torch.device("cpu")
    code = agreement.Op.LOW_LATENCY_DISPATCH if op == "dispatch" else agreement.Op.LOW_LATENCY_COMBINE
    words = agreement.rejected(f"low_latency_{op}", 4, 1, ValueError("x: bad"))
    assert words[agreement.Word.OP] == code

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=5))
    eng.reject(words)
    if op == "dispatch":
        assert seen == [("reject", 0, 1, 6), ("put", 0, 1, frozenset({3}))]
    else:
        assert seen == [("reject", 1, 0, 6), ("put_weights", 0, frozenset({3}))]
