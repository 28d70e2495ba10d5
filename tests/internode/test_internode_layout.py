"""The internode path's row sizes and regions come from the extension (csrc/runtime/internode_layout.hpp), and
they are byte for byte the formulas the Python side used before (restated here: these offsets are shared with the
GPU kernels and with peers, so the values must not move); the Python side reads the export instead of computing."""
import random
import types

import pytest

from deepcomm._ext import load_extension

C = load_extension()
pytestmark = pytest.mark.skipif(C is None, reason="deepcomm._C is not built (no nvcc at install time)")

TOPK = 32  # validation.MAX_TOPK, restated with the formulas below


def _up(n, m):
    return (n + m - 1) // m * m


# ---- the formulas the Python side computed before the export ----

def _old_region_layout(world_size, slot_bytes):
    off, at = {}, 0
    for name, nbytes in (("signal", 8 * world_size), ("credit", 8 * world_size), ("send", world_size * slot_bytes),
                         ("recv", world_size * slot_bytes)):
        off[name] = at
        at = _up(at + nbytes, 256)
    return off, at


def _old_nic_region(R, slot_bytes):  # NicTransport.__init__
    off, at = {}, 0
    for name, nbytes in (("signal", 8 * R), ("credit", 8 * R), ("fa_old", 16 * R), ("send", R * slot_bytes),
                         ("recv", R * slot_bytes)):
        off[name] = at
        at = _up(at + nbytes, 256)
    return off, at


def _old_node_link(gpus, area_bytes):
    return _up(3 * 8 * gpus, 256), _up(area_bytes, 256)  # flags_bytes, area_bytes


def _old_rows(max_tokens, hidden):
    node = _up(2 * hidden + TOPK * 12 + 8, 16)
    rail = max(node, _up(4 * hidden + TOPK * 4, 16))
    return node, rail, _up(8 * 64 + max_tokens * rail, 64)


def _sizes(rng, n, small, large):
    return [rng.randint(0, small) for _ in range(n // 2)] + [rng.randint(0, large) for _ in range(n - n // 2)]


def test_nvshmem_region_is_the_old_formula():
    rng = random.Random(25)
    cases = [(R, 16 * s) for R in (1, 2, 3, 8, 31, 32, 33, 64, 255, 256) for s in (0, 1, 15, 16, 17, 4096)]
    cases += [(rng.randint(1, 256), 16 * s) for s in _sizes(rng, 2000, 64, 1 << 26)]
    for R, slot in cases:
        off, total = _old_region_layout(R, slot)
        lay = C.nvshmem_region_layout(R, slot)
        assert lay == dict(off, total=total), (R, slot)
    for R, slot, arg in ((0, 16, "world_size"), (257, 16, "world_size"), (2, 24, "slot_bytes"), (2, -16, "slot_bytes")):
        with pytest.raises(ValueError, match=f"^{arg}: "):
            C.nvshmem_region_layout(R, slot)


def test_nic_region_is_the_old_formula():
    rng = random.Random(28)
    cases = [(R, 16 * s) for R in (1, 2, 3, 8, 15, 16, 17, 32, 64, 255, 256) for s in (0, 1, 15, 16, 17, 4096)]
    cases += [(rng.randint(1, 256), 16 * s) for s in _sizes(rng, 2000, 64, 1 << 26)]
    for R, slot in cases:
        off, total = _old_nic_region(R, slot)
        assert C.nic_region_layout(R, slot) == dict(off, total=total), (R, slot)
    for R, slot, arg in ((0, 16, "world_size"), (257, 16, "world_size"), (2, 24, "slot_bytes"), (2, -16, "slot_bytes")):
        with pytest.raises(ValueError, match=f"^{arg}: "):
            C.nic_region_layout(R, slot)


def test_node_link_region_is_the_old_formula():
    rng = random.Random(26)
    T = C.transport
    cases = [(G, a) for G in range(1, T.MAX_NODE_GPUS + 1) for a in (0, 1, 255, 256, 257)]
    cases += [(rng.randint(1, T.MAX_NODE_GPUS), a) for a in _sizes(rng, 2000, 4096, 1 << 34)]
    for G, area in cases:
        flags_bytes, area_bytes = _old_node_link(G, area)
        lay = C.node_link_layout(G, area)
        assert lay == {"flags": 0, "free": 8 * G, "arrive": 16 * G, "area": flags_bytes, "area_bytes": area_bytes,
                       "total": flags_bytes + area_bytes}, (G, area)
    for G, area, arg in ((0, 0, "gpus_per_node"), (T.MAX_NODE_GPUS + 1, 0, "gpus_per_node"), (2, -1, "area_bytes")):
        with pytest.raises(ValueError, match=f"^{arg}: "):
            C.node_link_layout(G, area)


def test_internode_rows_are_the_old_formula():
    rng = random.Random(27)
    assert C.TOPK_MAX == TOPK and C.RAIL_HEADER_BYTES == 64 and C.MAX_NODE_HEADERS == 8
    assert C.RAIL_HEADER_BYTES == 4 * C.FINGERPRINT_WORDS
    cases = [(M, H) for M in (0, 1, 128, 4096) for H in (0, 1, 7, 8, 128, 256, 2880, 4096, 7168)]
    cases += list(zip(_sizes(rng, 2000, 64, 1 << 16), _sizes(rng, 2000, 300, 1 << 16)))
    for M, H in cases:
        node, rail, slot = _old_rows(M, H)
        assert C.internode_rows(M, H) == {"node_row": node, "rail_row": rail, "slot": slot}, (M, H)
    for M, H, arg in ((-1, 128, "max_tokens"), (1, -1, "hidden")):
        with pytest.raises(ValueError, match=f"^{arg}: "):
            C.internode_rows(M, H)


# ---- the Python side reads the export ----

def test_nvshmem_transport_reads_the_export(monkeypatch):
    from deepcomm.internode import internode_layout, nvshmem_transport

    def shifted(world_size, slot_bytes):
        return {k: v + 512 for k, v in C.nvshmem_region_layout(world_size, slot_bytes).items()}

    monkeypatch.setattr(internode_layout, "extension", lambda: types.SimpleNamespace(nvshmem_region_layout=shifted))
    internode_layout.clear_caches()
    try:
        off, total = nvshmem_transport.region_layout(3, 4096)
        assert dict(off, total=total) == shifted(3, 4096)
    finally:
        monkeypatch.undo()
        internode_layout.clear_caches()
    assert nvshmem_transport.region_layout(3, 4096)[1] == C.nvshmem_region_layout(3, 4096)["total"]


def test_nic_transport_reads_the_export(monkeypatch):
    from deepcomm.internode import internode_layout, nic_transport

    def shifted(world_size, slot_bytes):
        return {k: v + 256 for k, v in C.nic_region_layout(world_size, slot_bytes).items()}

    monkeypatch.setattr(internode_layout, "extension", lambda: types.SimpleNamespace(nic_region_layout=shifted))
    internode_layout.clear_caches()
    try:
        off, total = nic_transport.region_layout(4, 1024)
        assert dict(off, total=total) == shifted(4, 1024)
    finally:
        monkeypatch.undo()
        internode_layout.clear_caches()
    off, total = nic_transport.region_layout(4, 1024)
    assert dict(off, total=total) == C.nic_region_layout(4, 1024)


def test_internode_rows_read_the_export(monkeypatch):
    from deepcomm.internode import internode_layout, internode_rows

    def shifted(max_tokens, hidden):
        return {k: v + 16 for k, v in C.internode_rows(max_tokens, hidden).items()}

    monkeypatch.setattr(internode_layout, "extension", lambda: types.SimpleNamespace(internode_rows=shifted))
    internode_layout.clear_caches()
    try:
        assert internode_rows.max_node_row_bytes(256) == shifted(0, 256)["node_row"]
        assert internode_rows.max_row_bytes(256) == shifted(0, 256)["rail_row"]
        assert internode_rows.rail_slot_bytes(64, 256) == shifted(64, 256)["slot"]
    finally:
        monkeypatch.undo()
        internode_layout.clear_caches()
    assert internode_rows.rail_slot_bytes(64, 256) == C.internode_rows(64, 256)["slot"]
    assert (internode_rows.RAIL_HEADER_BYTES, internode_rows.MAX_NODE_HEADERS) == (C.RAIL_HEADER_BYTES,
                                                                                   C.MAX_NODE_HEADERS)


def test_node_link_reads_the_export(monkeypatch):
    """NodeLink sizes and carves its region with node_link_layout: a made-up layout (everything moved) is what its
    pointers follow. Built without IPC or a GPU: the peer memory, device view and error record are stand-ins."""
    import deepcomm.internode.node_link as node_link

    asked = []

    class _Mem:
        def __init__(self, C_, group, rank, world_size, nbytes, peers):
            asked.append(nbytes)
            self.ptr = 0x10000000 + rank * 0x1000000
            self.peer_ptrs = {p: 0x10000000 + p * 0x1000000 for p in peers}

        def close(self):
            pass

    def moved(gpus, area_bytes):
        lay = C.node_link_layout(gpus, area_bytes)
        return {k: v + (1024 if k in ("flags", "free", "arrive", "area", "total") else 0) for k, v in lay.items()}

    fake = types.SimpleNamespace(transport=C.transport, node_link_layout=moved, error_record_bytes=lambda: 64,
                                 host_mapped_alloc=lambda nbytes: (0, 0), clear_error=lambda ptr: None)
    monkeypatch.setattr(node_link, "PeerMemory", _Mem)
    monkeypatch.setattr(node_link, "as_device_bytes", lambda ptr, nbytes, device, owner: (ptr, nbytes))
    link = node_link.NodeLink(fake, None, 5, 8, 4, "cpu", 1000, 1.0)
    lay = moved(4, 1000)
    assert asked == [lay["total"]] and link.area_bytes == lay["area_bytes"]
    assert link.region == (0x10000000 + 5 * 0x1000000 + lay["area"], lay["area_bytes"])
    bases = [0x10000000 + (4 + i) * 0x1000000 for i in range(4)]
    assert link.area_ptrs() == [b + lay["area"] for b in bases]
    assert link.word_ptrs("free") == [b + lay["free"] for b in bases]
    assert link.word_ptrs("arrive") == [b + lay["arrive"] for b in bases]
    assert link._flags == [b + lay["flags"] for b in bases]  # the node barrier's words


def test_words_strip_is_rail_major_at_the_area_end():
    """The strip of call words (several GPUs per node): one 64-byte header per rank at the end of the area, rank s =
    (node s // G, GPU s % G) at slot (s % G) * N + s // G, so one rail's words are contiguous; hier_agree reads the
    export, as the kernels' words_slot does."""
    from deepcomm.internode import hier_agree
    for N, G in ((2, 2), (2, 4), (4, 2), (3, 8), (32, 8), (5, 1)):
        area = N * G * 64 + 1000 * 16
        w = C.words_strip(N, G, area)
        assert w["bytes"] == N * G * 64 and w["at"] == area - w["bytes"]
        assert list(w["slots"]) == [(s % G) * N + s // G for s in range(N * G)]
        assert sorted(w["slots"]) == list(range(N * G))
        comm = types.SimpleNamespace(num_nodes=N, gpus=G, world_size=N * G,
                                     link=types.SimpleNamespace(area_bytes=area))
        assert hier_agree.strip_at(comm) == w["at"] and hier_agree.strip_bytes(N * G) == w["bytes"]
        assert [hier_agree.strip_slot(comm, s) for s in range(N * G)] == list(w["slots"])
    with pytest.raises(ValueError, match="area_bytes"):
        C.words_strip(2, 2, 100)
    with pytest.raises(ValueError, match="num_nodes"):
        C.words_strip(64, 8, 1 << 20)
