"""The internode NVSHMEM transport off the GPU (deepcomm/internode/nvshmem_transport.py): the symmetric block's layout,
the NVSHMEM calls a round issues (addresses, signal values, zero-byte blocks, bad sizes, rail peers only), a whole
round protocol carried out between CPU processes by a stand-in that applies those calls with NVSHMEM's
symmetric-address rule (under the hierarchical routing, hier_normal.py over HierComm with the NVLink hop of
tests/internode/test_internode_comm.py: dispatch and combine equal the reference backend bit for bit, and no call goes to a
rank that is not a rail peer), a Buffer refusing an unknown transport (the setting itself:
tests/api/test_config_choices.py), the stage names, and the extension's NVSHMEM symbol table.
The GPU run: tests/internode/test_internode_nvshmem.py."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from deepcomm.internode.nvshmem_transport import (NvshmemTransport, Op, TOTAL_FIELDS, block_ops, credit_ops,
                                             region_layout)
from tests.helpers.multiproc import run_ranks
from tests.helpers.paths import ROOT


def _extension():
    from deepcomm._ext import load_extension
    return load_extension()


# ---- layout and the calls of one round ----

def test_region_layout():
    off, total = region_layout(3, 4096)
    assert off == {"signal": 0, "credit": 256, "send": 512, "recv": 512 + 3 * 4096}
    assert total == 512 + 6 * 4096
    off, total = region_layout(40, 16)  # counters longer than one alignment unit
    assert off == {"signal": 0, "credit": 512, "send": 1024, "recv": 1024 + 768} and total == 1024 + 2 * 768
    assert all(v % 256 == 0 for v in off.values()) and total % 256 == 0
    with pytest.raises(ValueError, match="world_size"):
        region_layout(0, 16)
    with pytest.raises(ValueError, match="slot_bytes"):
        region_layout(2, 24)


def test_round_calls():
    base, R, me, slot, rnd = 0x7F0000000000, 3, 1, 1024, 5
    off, _ = region_layout(R, slot)
    assert credit_ops(base, off, me, R, rnd) == [Op("credit", 0, base + off["credit"] + 8, 5),
                                                Op("credit", 2, base + off["credit"] + 8, 5)]
    ops = block_ops(base, off, slot, me, R, rnd, [48, 999999, 0], [0, 48, 48])  # own entry: ignored
    assert ops == [Op("put", 0, base + off["signal"] + 8, 5, dest=base + off["recv"] + slot,
                      source=base + off["send"], nbytes=48),
                   Op("signal", 2, base + off["signal"] + 8, 5)]  # a zero-byte block still signals
    with pytest.raises(ValueError, match=r"^x: 1040 bytes for rank 2 exceed the receive slot \(1024 bytes\)"):
        block_ops(base, off, slot, me, R, rnd, [0, 0, 1040], [0, 0, 0])
    with pytest.raises(ValueError, match="send_begin: block for rank 0"):
        block_ops(base, off, slot, me, R, rnd, [32, 0, 0], [3 * slot - 16, 0, 0])
    with pytest.raises(ValueError, match="send_bytes: expected 3 entries"):
        block_ops(base, off, slot, me, R, rnd, [32, 0], [0, 0])


def test_round_calls_rail_peers_only():
    """With peers (the rail: our local index on the other nodes), a round calls those ranks only; bytes for any
    other rank are refused before anything is issued, as NicTransport(peers=...) does."""
    base, R, me, slot, rnd = 0x7F0000000000, 6, 4, 1024, 2  # 3 nodes x 2 GPUs: rank 4's rail is 0, 2
    off, _ = region_layout(R, slot)
    rail = [0, 2, 4]  # our own rank may be listed: it is dropped
    assert credit_ops(base, off, me, R, rnd, rail) == [Op("credit", 0, base + off["credit"] + 32, 2),
                                                      Op("credit", 2, base + off["credit"] + 32, 2)]
    ops = block_ops(base, off, slot, me, R, rnd, [0, 0, 64, 0, 0, 0], [0, 0, 0, 0, 0, 0], rail)
    assert ops == [Op("signal", 0, base + off["signal"] + 32, 2),
                   Op("put", 2, base + off["signal"] + 32, 2, dest=base + off["recv"] + 4 * slot,
                      source=base + off["send"], nbytes=64)]
    with pytest.raises(ValueError, match=r"^send_bytes: rank 5 is not a peer of this transport \(peers \[0, 2\]\)"):
        block_ops(base, off, slot, me, R, rnd, [0, 0, 0, 0, 0, 16], [0] * R, rail)
    for bad in ([4], [0, 6], [-1, 2]):
        with pytest.raises(ValueError, match="^peers: expected ranks in"):
            credit_ops(base, off, me, R, rnd, bad)
    # the transport checks its peers before it touches the extension or NVSHMEM
    with pytest.raises(ValueError, match="^peers: expected ranks in"):
        NvshmemTransport(None, None, 1, 4, torch.device("cpu"), 16, 256, 1.0, peers=[1])


class _RecordedRounds:
    """A stand-in for deepcomm._nvshmem_kernels' ``rail_round``: records each launch's arguments."""
    RAIL_ROUND_MAX_PEERS = 3

    def __init__(self):
        self.launches = []

    def rail_round(self, *args):
        self.launches.append(args)


def _planned(rank, world, slot, peers):
    """A transport with only its round planning (no NVSHMEM, no GPU)."""
    tr = object.__new__(NvshmemTransport)
    tr.rank, tr.world_size, tr.slot_bytes, tr.peers = rank, world, slot, list(peers)
    tr.offsets, _ = region_layout(world, slot)
    tr.base, tr.err_dev, tr.timeout_s = 0x7F0000000000, 0x1000, 2.5
    return tr


def test_round_from_the_gpu_takes_the_host_rounds_arguments():
    """A round issued from the GPU (csrc/nvshmem_kernels/rail_round.hpp) gets the host round's addresses: our
    counters and areas, every peer's bytes and offset into the send area, in peer order; the credit value is the
    round, the signal value what the host round SETs."""
    R, me, slot = 4, 2, 1024
    tr = _planned(me, R, slot, [0, 1, 3])
    kernels = _RecordedRounds()
    tr.issue_rounds_from(kernels)
    assert tr._device_rounds is kernels
    tr._launch_round(7, 56, [48, 0, 999, 32], [0, 48, 0, 64], stream=0xABC)
    (args,) = kernels.launches
    off = tr.offsets
    assert args == (tr.base + off["signal"], tr.base + off["credit"], tr.base + off["send"], tr.base + off["recv"],
                    slot, me, 7, 56, [0, 1, 3], [48, 0, 32], [0, 48, 64], 0x1000, 2.5, 0xABC)
    # the puts the host round would issue for those blocks land at the same place: slot [me] of each peer
    ops = block_ops(tr.base, off, slot, me, R, 56, [48, 0, 0, 32], [0, 48, 0, 64], tr.peers)
    assert [(o.pe, o.dest, o.source, o.nbytes) for o in ops if o.kind == "put"] == [
        (0, args[3] + me * slot, args[2] + 0, 48), (3, args[3] + me * slot, args[2] + 64, 32)]


def test_more_peers_than_one_launch_keep_the_host_round():
    tr = _planned(0, 5, 256, [1, 2, 3, 4])  # 4 peers, the stand-in launch takes 3
    tr.issue_rounds_from(_RecordedRounds())
    assert tr._device_rounds is None


def test_slot_fits_the_hierarchical_rows():
    """One receive slot holds what a rail rank can send us in one round: a row per token of its own, the widest
    being the fp32 combine partial (fp32 x + fp32 weights) or the dispatch row; both transports size it alike."""
    from deepcomm.internode.internode_rows import max_node_row_bytes, max_row_bytes, rail_slot_bytes
    from deepcomm.validation import MAX_TOPK
    for H in (256, 2880, 7168):
        partial = (4 * H + 4 * MAX_TOPK + 15) // 16 * 16
        assert max_row_bytes(H) == max(partial, max_node_row_bytes(H)) == partial
        assert rail_slot_bytes(128, H) >= 128 * partial and rail_slot_bytes(128, H) % 64 == 0


# ---- a round protocol between CPU processes ----

class _SymmetricStandIn(NvshmemTransport):
    """The transport's views and round planning, with its symmetric block in CPU memory at a made-up base address
    (different on every rank: only offsets may carry over) and the NVSHMEM calls applied by their target: a put
    writes at the same offset of the target's block, then the signal is SET, as NVSHMEM does."""

    def __init__(self, rank, world, slot_bytes, peers):  # no NVSHMEM, no GPU: only what the methods under test use
        self.rank, self.world_size, self.slot_bytes = rank, world, slot_bytes
        self.offsets, self.region_bytes = region_layout(world, slot_bytes)
        self.base = 0x7F0000000000 + rank * 0x100000000 + 0x4000
        self.region = torch.zeros(self.region_bytes, dtype=torch.uint8)
        self.peers = sorted(set(peers) - {rank})
        self.totals = {p: dict.fromkeys(TOTAL_FIELDS, 0) for p in self.peers}
        self.round, self.broken = 0, False
        self.sent = {p: [] for p in self.peers}  # per peer, the bytes of every round (0: a lone signal)

    def exchange(self, send_bytes, send_begin):
        r = self.round + 1
        blocks = block_ops(self.base, self.offsets, self.slot_bytes, self.rank, self.world_size, r, send_bytes,
                           send_begin, self.peers)
        self.round = r
        for p in self.peers:
            self.sent[p].append(int(send_bytes[p]))
        self._deliver(credit_ops(self.base, self.offsets, self.rank, self.world_size, r, self.peers))
        assert all(self.counters("credit")[p] == r for p in self.peers), self.counters("credit")
        o = self.offsets["recv"]
        self.region[o:o + self.world_size * self.slot_bytes] = 0xEE  # stale bytes must never be read
        self._deliver(blocks)
        assert all(self.counters("signal")[p] == r for p in self.peers), self.counters("signal")
        others = [p for p in range(self.world_size) if p != self.rank and p not in self.peers]
        assert all(self.counters(c)[p] == 0 for c in ("credit", "signal") for p in others), "a non-peer called us"

    def _deliver(self, ops):
        sent = []
        for op in ops:
            self._count(op)
            data = b""
            if op.kind == "put":
                at = op.source - self.base
                assert self.offsets["send"] <= at and at + op.nbytes <= self.offsets["recv"], op
                data = self.region[at:at + op.nbytes].numpy().tobytes()
            sent.append((op, data))
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, (self.base, sent))
        for s, (base, ops_s) in enumerate(everyone):
            for op, data in ops_s:
                if op.pe != self.rank:
                    continue
                if op.kind == "put":  # NVSHMEM: the sender's symmetric address names the same offset here
                    at = op.dest - base
                    assert at == self.offsets["recv"] + s * self.slot_bytes, (s, op)
                    self.region[at:at + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                at = op.sig_addr - base
                assert at == self.offsets["credit" if op.kind == "credit" else "signal"] + 8 * s, (s, op)
                self.region[at:at + 8].view(torch.int64)[0] = op.value  # NVSHMEM_SIGNAL_SET


def _worker(rank, world, G, folder):
    from deepcomm.internode.hier_comm import HierComm
    from deepcomm.internode.hier_normal import combine, dispatch
    from deepcomm.internode.internode_rows import max_node_row_bytes, rail_slot_bytes
    from deepcomm.fp8 import per_token_cast_to_fp8
    from deepcomm.reference import normal
    from deepcomm.reference.collectives import Comm
    from tests.internode.test_internode_comm import _same, _StandInLink

    dev = torch.device("cpu")
    E, K, M, H = 4 * world, 3, 40, 256
    rail = [m * G + rank % G for m in range(world // G)]  # as InternodeBackend passes them
    tr = _SymmetricStandIn(rank, world, rail_slot_bytes(M, H), rail)
    link = _StandInLink(rank, world, G, world * M * max_node_row_bytes(H), folder)
    comm = HierComm(tr, link, rank, world, G, dev)
    ref = Comm(None, rank, world, dev, 30.0)
    gen = torch.Generator().manual_seed(9 + rank)
    for T, fp8, mode in ((0 if rank == 0 else 33, False, "masked"), (1, True, "masked"), (M, False, "masked"),
                         (17, True, "one_expert")):
        what = f"rank {rank} T={T} {mode} {'fp8' if fp8 else 'bf16'}"
        idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
        idx[torch.rand(T, K, generator=gen) < 0.3] = -1
        if mode == "one_expert":  # every row to the last rank: other rail peers get zero-byte blocks
            idx[:] = -1
            idx[:, 0] = E - 1
        w = torch.rand(T, K, generator=gen)
        x = (torch.randn(T, H, generator=gen) * 2).to(torch.bfloat16)
        x = per_token_cast_to_fp8(x) if fp8 else x
        a = dispatch(comm, x, idx, w, E, None, 1)
        b = normal.dispatch(ref, x, idx, w, E, None, 1)
        _same(a[:4], b[:4], f"{what}: dispatch")
        for f in ("num_recv", "count_matrix", "recv_src_idx", "is_token_in_rank", "send_pos"):
            _same(getattr(a[4], f), getattr(b[4], f), f"{what}: handle.{f}")
        n = a[4].num_recv
        y = torch.randn(n, H, generator=gen).to(torch.bfloat16)
        yw = torch.rand(n, K, generator=gen)
        _same(combine(comm, y, a[4], yw, False), normal.combine(ref, y, b[4], yw, False, G), f"{what}: combine")
    return tr.round, tr.transfer_totals(), tr.sent


@pytest.mark.parametrize("world,gpn", [(3, 1), (4, 2)])
def test_round_protocol_under_hierarchical_routing_matches_reference(world, gpn, tmp_path):
    results = run_ranks(_worker, world, gpn, str(tmp_path))
    zero_rounds = 0
    for rank, (rounds, totals, sent) in enumerate(results):
        assert rounds == 4 * 3  # per case: counts, payload, combine
        rail = sorted(m * gpn + rank % gpn for m in range(world // gpn) if m != rank // gpn)
        assert sorted(totals) == rail, (rank, sorted(totals))  # calls to the rail peers only
        for p, t in totals.items():  # one credit and one put or lone signal per round and peer
            zeros = sum(1 for b in sent[p] if b == 0)
            assert t == dict(credits=rounds, puts=rounds - zeros, signals=zeros, bytes=sum(sent[p])), (rank, p, t)
            assert t["bytes"] > 0  # the counts rounds at least
            zero_rounds += zeros
    assert zero_rounds > 0  # some rounds sent a peer nothing (rank 0's first case, the one_expert case)


# ---- selection ----

def _buffer_worker(rank, world):
    import deepcomm
    try:
        deepcomm.Buffer(backend="reference", internode_transport="rdma", gpus_per_node=1)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_buffer_rejects_unknown_transport():
    assert all(m.startswith("internode_transport: expected one of") for m in run_ranks(_buffer_worker, 2))


def test_several_hosts_need_the_nvshmem_transport(monkeypatch):
    from deepcomm import backends
    monkeypatch.setattr(backends, "hosts_of", lambda group: ["a", "b"])
    assert "DEEPCOMM_INTERNODE_TRANSPORT=nvshmem" in backends.internode_unavailable_reason(None, 2, "emulated")
    assert backends.internode_unavailable_reason(None, 2, "nvshmem") is None
    assert "at most 256 ranks" in backends.internode_unavailable_reason(None, 257, "nvshmem", 8)
    assert "at most 32 nodes" in backends.internode_unavailable_reason(None, 66, "nvshmem", 2)
    monkeypatch.setattr(backends, "hosts_of", lambda group: ["a", "a"])
    assert backends.internode_unavailable_reason(None, 2, "emulated") is None
    # 2 nodes x 2 GPUs: each node on its own host is fine over NVSHMEM; a node split over hosts is not
    monkeypatch.setattr(backends, "hosts_of", lambda group: ["a", "a", "b", "b"])
    assert backends.internode_unavailable_reason(None, 4, "nvshmem", 2) is None
    assert "several hosts; the internode CUDA" in backends.internode_unavailable_reason(None, 4, "emulated", 2)
    monkeypatch.setattr(backends, "hosts_of", lambda group: ["a", "b", "a", "b"])
    assert "node 0 (gpus_per_node=2) are on several hosts (a, b)" in \
        backends.internode_unavailable_reason(None, 4, "nvshmem", 2)


# ---- the extension ----

@pytest.mark.skipif(_extension() is None, reason="deepcomm._C is not built")
def test_wait_stages_have_names():
    from deepcomm.cuda.wait_stages import stage_text
    C = _extension()
    T = C.transport
    assert stage_text(C, T.STAGE_NVSHMEM_CREDIT).startswith("nvshmem:credit ")
    assert stage_text(C, T.STAGE_NVSHMEM_SIGNAL).startswith("nvshmem:signal ")
    assert stage_text(C, T.STAGE_NODE_BARRIER).startswith("node:barrier ")
    assert (T.STAGE_NVSHMEM_CREDIT, T.STAGE_NVSHMEM_SIGNAL, T.STAGE_NODE_BARRIER) == (27, 28, 29)
    assert T.MAX_COUNTER_WAIT_RANKS >= 32 and callable(T.wait_counters)


@pytest.mark.skipif(_extension() is None or not hasattr(_extension(), "nvshmem"),
                    reason="deepcomm._C built without the NVSHMEM headers")
def test_symbol_table_has_the_stream_calls():
    n = _extension().nvshmem
    names = n.symbol_names()
    for name in ("nvshmemx_putmem_signal_on_stream", "nvshmemx_signal_op_on_stream", "nvshmemx_quiet_on_stream",
                 "nvshmem_malloc", "nvshmemx_hostlib_init_attr"):
        assert name in names, names
    assert "nvshmemx_signal_wait_until_on_stream" not in names  # unbounded: never used
    assert (n.SIGNAL_SET, n.SIGNAL_ADD) == (9, 10)  # NVSHMEM 3.x nvshmemx_signal_op_t, from the headers
    # Before NVSHMEM is loaded (a fresh process), the calls raise naming themselves instead of crashing.
    p = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        from deepcomm._ext import load_extension
        n = load_extension().nvshmem
        for call, args in (("putmem_signal_on_stream", (0, 0, 16, 0, 1, n.SIGNAL_SET, 1, 0)),
                           ("signal_op_on_stream", (0, 1, n.SIGNAL_SET, 1, 0)), ("quiet_on_stream", (0,))):
            try:
                getattr(n, call)(*args)
                print(call, "returned")
            except RuntimeError as exc:
                print(exc)
        """)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, timeout=120)
    for call in ("putmem_signal_on_stream", "signal_op_on_stream", "quiet_on_stream"):
        assert f"deepcomm: {call}: NVSHMEM's host library is not loaded" in p.stdout, p.stdout


@pytest.mark.skipif(_extension() is None or shutil.which("readelf") is None, reason="needs deepcomm._C and readelf")
def test_extension_links_no_nvshmem():
    out = subprocess.run(["readelf", "-d", _extension().__file__], text=True, stdout=subprocess.PIPE).stdout
    needed = [line for line in out.splitlines() if "(NEEDED)" in line]
    assert needed and not any("nvshmem" in line or "libcuda.so" in line for line in needed), needed
