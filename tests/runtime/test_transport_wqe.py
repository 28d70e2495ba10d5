"""Internode transport on the host: mlx5 WQE encoding and byte order, the send ring and doorbell record, the
emulated NIC and the CPU proxy (deepcomm._C.transport). Runs wherever the extension is built, CI included."""
import random
import time

import pytest
import torch

from deepcomm._ext import load_extension, load_selftest

C = load_extension()
S = load_selftest()  # the test-only module: the ptx/ host twins
T = getattr(C, "transport", None)
pytestmark = pytest.mark.skipif(T is None, reason="deepcomm._C (with its transport module) is not built")

LKEY, RKEY, CNT_KEY, RES_KEY = 0x11, 0x22, 0x33, 0x44
REMOTE_BASE = 0x7000_0000_0000  # the "remote node's" address space, translated by the key table


def _h(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", "").replace("\n", ""))


def _buffers(nbytes=1 << 14, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    keys = T.KeyTable()
    keys.add(LKEY, src.data_ptr(), nbytes, src.data_ptr())
    keys.add(RKEY, REMOTE_BASE, nbytes, dst.data_ptr())
    return src, dst, keys


# ---------------------------------------------------------------- byte order, by hand


def test_rdma_write_bytes_by_hand():
    ring = T.encode_rdma_write(log_wqebbs=0, qpn=0x000123, wqe_index=5, laddr=0x00007E0055667780, lkey=0x1234,
                               raddr=0x00007F0011223340, rkey=0xABCDEF, bytes=0x100,
                               fm_ce_se=T.CTRL_CQ_UPDATE | T.CTRL_SOLICITED, signature=0xA5, imm=0x11223344,
                               with_imm=True)
    expected = _h("""
        00 00 05 09  00 01 23 03  a5 00 00 0a  11 22 33 44
        00 00 7f 00 11 22 33 40  00 ab cd ef  00 00 00 00
        00 00 01 00  00 00 12 34  00 00 7e 00 55 66 77 80
        00 00 00 00 00 00 00 00  00 00 00 00 00 00 00 00""")
    # ctrl: opmod 0 | index 0x0005 | opcode RDMA_WRITE_IMM; qpn 0x000123 | ds 3; signature, 2 reserved,
    # fm_ce_se = CQ_UPDATE (0x08) | SOLICITED (0x02); imm. raddr: raddr, rkey, reserved. data: count, lkey, addr.
    assert ring == expected


def test_fetch_add_bytes_by_hand():
    ring = T.encode_fetch_add(log_wqebbs=0, qpn=0xABCDEF, wqe_index=0x1234, laddr=0x00007FFFDEADBE00,
                              lkey=0x0A0B0C0D, raddr=0x0000100000000008, rkey=0x01020304, add=0x0102030405060708)
    expected = _h("""
        00 12 34 12  ab cd ef 04  00 00 00 08  00 00 00 00
        00 00 10 00 00 00 00 08  01 02 03 04  00 00 00 00
        01 02 03 04 05 06 07 08  00 00 00 00 00 00 00 00
        00 00 00 08  0a 0b 0c 0d  00 00 7f ff de ad be 00""")
    # ctrl: index 0x1234 | opcode ATOMIC_FA (0x12); qpn 0xabcdef | ds 4; CQ_UPDATE. atomic: add, compare (unused).
    # data: the 8 bytes where the old value lands.
    assert ring == expected


def test_inline_write_bytes_by_hand():
    ring = T.encode_rdma_write_inline(log_wqebbs=0, qpn=7, wqe_index=0, payload=b"\xde\xad\xbe\xef\x01",
                                      raddr=0x40, rkey=9)
    expected = _h("""
        00 00 00 08  00 00 07 03  00 00 00 08  00 00 00 00
        00 00 00 00 00 00 00 40  00 00 00 09  00 00 00 00
        80 00 00 05  de ad be ef  01 00 00 00  00 00 00 00
        00 00 00 00 00 00 00 00  00 00 00 00 00 00 00 00""")
    # inline header: MLX5_INLINE_SEG | 5 bytes, then the payload padded to 16 bytes: ds = 2 + ceil(9 / 16) = 3
    assert ring == expected


# ---------------------------------------------------------------- encode -> decode round trip


def _random_wqe(rng):
    kind = rng.choice(["write", "write_imm", "fetch_add", "inline"])
    common = dict(log_wqebbs=2, qpn=rng.getrandbits(24), wqe_index=rng.getrandbits(16))
    if kind == "fetch_add":
        fields = dict(laddr=rng.getrandbits(64), lkey=rng.getrandbits(32), raddr=rng.getrandbits(64),
                      rkey=rng.getrandbits(32), add=rng.getrandbits(64), fm_ce_se=rng.getrandbits(8),
                      signature=rng.getrandbits(8))
        return kind, fields, T.encode_fetch_add(**common, **fields), common
    if kind == "inline":
        payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, T.MAX_INLINE_BYTES)))
        fields = dict(payload=payload, raddr=rng.getrandbits(64), rkey=rng.getrandbits(32),
                      fm_ce_se=rng.getrandbits(8))
        return kind, fields, T.encode_rdma_write_inline(**common, **fields), common
    fields = dict(laddr=rng.getrandbits(64), lkey=rng.getrandbits(32), raddr=rng.getrandbits(64),
                  rkey=rng.getrandbits(32), bytes=rng.getrandbits(31), fm_ce_se=rng.getrandbits(8),
                  signature=rng.getrandbits(8), imm=rng.getrandbits(32), with_imm=kind == "write_imm")
    return kind, fields, T.encode_rdma_write(**common, **fields), common


def test_encode_decode_round_trip_random():
    rng = random.Random(1234)
    for _ in range(400):
        kind, f, ring, common = _random_wqe(rng)
        d = T.decode_wqe(ring, common["wqe_index"])
        assert d["status"] == 0, (kind, d)
        assert d["wqe_index"] == common["wqe_index"] and d["qpn"] == common["qpn"] and d["opmod"] == 0
        assert d["fm_ce_se"] == f["fm_ce_se"] and d["raddr"] == f["raddr"] and d["rkey"] == f["rkey"]
        if kind == "inline":
            assert d["opcode"] == T.OP_RDMA_WRITE and d["is_inline"]
            assert d["bytes"] == len(f["payload"]) and d["payload"] == f["payload"]
            assert d["ds"] == 2 + (4 + len(f["payload"]) + 15) // 16
            continue
        assert d["laddr"] == f["laddr"] and d["lkey"] == f["lkey"] and d["signature"] == f["signature"]
        if kind == "fetch_add":
            assert (d["opcode"], d["ds"], d["add"], d["compare"], d["bytes"]) == (T.OP_ATOMIC_FA, 4, f["add"], 0, 8)
        else:
            assert d["opcode"] == (T.OP_RDMA_WRITE_IMM if f["with_imm"] else T.OP_RDMA_WRITE)
            assert (d["ds"], d["bytes"], d["imm"], d["is_inline"]) == (3, f["bytes"], f["imm"], False)


def test_decode_rejects_malformed_wqes():
    good = bytearray(T.encode_rdma_write(log_wqebbs=0, qpn=1, wqe_index=0, laddr=0, lkey=1, raddr=0, rkey=2,
                                         bytes=8))
    bad_opcode = bytearray(good)
    bad_opcode[3] = 0x0A  # MLX5_OPCODE_SEND: not executed by this NIC
    assert T.decode_wqe(bytes(bad_opcode), 0)["status"] == 1
    bad_size = bytearray(good)
    bad_size[7] = 4  # ds 4 for a write with a data segment
    assert T.decode_wqe(bytes(bad_size), 0)["status"] == 2


# ---------------------------------------------------------------- doorbell record and register


def test_doorbell_record_values():
    for pi in [0, 1, 0xFF, 0x100, 0xFFFF, 0x10000, 0x12345, 0xFFFFFFFF]:
        raw = T.dbrec_value(pi).to_bytes(4, "little")  # as it lies in memory
        assert raw == (pi & 0xFFFF).to_bytes(4, "big")
        if S is not None:  # and the ptx/ host twin agrees
            assert T.dbrec_value(pi) == S.bswap32_host(pi & 0xFFFF)
        reg = T.doorbell_value(pi, 0xABCDEF).to_bytes(8, "little")
        assert reg == ((pi & 0xFFFF) << 8).to_bytes(4, "big") + (0xABCDEF << 8).to_bytes(4, "big")


def test_queue_pair_doorbell_after_posts_and_16bit_wrap():
    src, dst, keys = _buffers(1 << 12)
    qp = T.QueuePair(log_wqebbs=6, log_cqes=7, qpn=0x42)
    nic = T.Nic(qp, keys)
    assert qp.dbrec_bytes() == bytes(8)
    posted = 0
    while posted < 70_000:  # past 0xffff: the record and the NIC's compare wrap at 16 bits
        for _ in range(qp.free_wqebbs):
            off = (posted * 8) % 4096
            qp.post_write(src.data_ptr() + off, LKEY, REMOTE_BASE + off, RKEY, 8, signaled=(posted % 16 == 15))
            posted += 1
        qp.ring()
        assert qp.dbrec_bytes() == bytes(4) + (posted & 0xFFFF).to_bytes(4, "big")
        assert qp.doorbell_register_bytes() == ((posted & 0xFFFF) << 8).to_bytes(4, "big") + (0x42 << 8).to_bytes(4, "big")
        assert nic.drain() == (qp.wqebbs, T.DRAIN_CAUGHT_UP)
        comps = qp.poll()
        assert [c["wqe_counter"] for c in comps] == [(posted - qp.wqebbs + i) & 0xFFFF for i in range(15, qp.wqebbs, 16)]
        assert all(c["cqe_opcode"] == T.CQE_REQ and c["byte_count"] == 8 for c in comps)
    assert nic.consumer_index == posted and qp.retired_index == posted and nic.error == 0
    assert torch.equal(dst, src)


# ---------------------------------------------------------------- ring wrap-around, completions


def test_ring_wraparound_with_drains_in_between():
    src, dst, keys = _buffers(1 << 12, seed=1)
    qp = T.QueuePair(log_wqebbs=3, log_cqes=4, qpn=3)
    nic = T.Nic(qp, keys)
    expected = torch.zeros_like(dst)
    rng = random.Random(5)
    total = 0
    for round_ in range(20):  # 20 rounds of up to 7 WQEBBs through an 8-WQEBB ring
        for _ in range(rng.randint(1, 3)):
            off, n = rng.randrange(0, 4000), rng.randint(1, 96)
            if rng.random() < 0.5:
                payload = bytes(src[off:off + n].tolist())
                if qp.free_wqebbs < (2 + (4 + n + 15) // 16 + 3) // 4:
                    break
                qp.post_write_inline(payload, REMOTE_BASE + off, RKEY)
            else:
                if qp.free_wqebbs < 1:
                    break
                qp.post_write(src.data_ptr() + off, LKEY, REMOTE_BASE + off, RKEY, n)
            expected[off:off + n] = src[off:off + n]
            total += 1
        qp.ring()
        nic.drain()
        qp.poll()
        assert qp.free_wqebbs == qp.wqebbs
    assert qp.producer_index > 4 * qp.wqebbs and total > 20
    assert torch.equal(dst, expected)


def test_multi_wqebb_inline_wqe_spans_the_ring_end():
    src, dst, keys = _buffers(1 << 10, seed=2)
    qp = T.QueuePair(log_wqebbs=3, log_cqes=3, qpn=9)
    nic = T.Nic(qp, keys)
    for i in range(6):  # move the producer index to slot 6
        qp.post_write(src.data_ptr(), LKEY, REMOTE_BASE, RKEY, 1)
    qp.ring(), nic.drain(), qp.poll()
    payload = bytes(range(200))  # ds = 2 + ceil(204 / 16) = 15: 4 WQEBBs, slots 6, 7, 0, 1
    index = qp.post_write_inline(payload, REMOTE_BASE + 300, RKEY)
    assert index == 6 and qp.producer_index == 10
    d = T.decode_wqe(qp.sq_bytes(), index)
    assert (d["status"], d["wqebbs"], d["payload"]) == (0, 4, payload)
    qp.ring()
    assert nic.drain() == (1, T.DRAIN_CAUGHT_UP)
    assert [c["wqe_counter"] for c in qp.poll()] == [6]
    assert bytes(dst[300:500].tolist()) == payload


def test_cqe_bytes_and_owner_bit_per_pass():
    src, dst, keys = _buffers(1 << 10)
    qp = T.QueuePair(log_wqebbs=4, log_cqes=2, qpn=0x0A0B0C)
    nic = T.Nic(qp, keys)
    assert qp.cqe_bytes(0)[63] == T.CQE_INVALID << 4  # fresh CQEs: invalid, owner 0
    owners = []
    for i in range(11):
        qp.post_write(src.data_ptr(), LKEY, REMOTE_BASE, RKEY, 0x1234 % 1024 + i)
        qp.ring()
        nic.drain()
        cqe = qp.cqe_bytes(i)
        assert cqe[44:48] == (0x1234 % 1024 + i).to_bytes(4, "big")        # byte_cnt
        assert cqe[56:60] == bytes([T.OP_RDMA_WRITE, 0x0A, 0x0B, 0x0C])  # WQE opcode | QPN
        assert cqe[60:62] == i.to_bytes(2, "big")                          # wqe_counter
        assert cqe[63] >> 4 == T.CQE_REQ and cqe[63] & 1 == (i >> 2) & 1   # owner flips every 4 CQEs
        (c,) = qp.poll()
        owners.append(c["owner"])
    assert owners == [(i >> 2) & 1 for i in range(11)]


def test_full_cq_pauses_the_nic():
    src, dst, keys = _buffers(1 << 10)
    qp = T.QueuePair(log_wqebbs=4, log_cqes=2, qpn=1)
    nic = T.Nic(qp, keys)
    for i in range(6):
        qp.post_write(src.data_ptr() + i, LKEY, REMOTE_BASE + i, RKEY, 1)
    qp.ring()
    assert nic.drain() == (4, T.DRAIN_CQ_FULL)
    assert len(qp.poll()) == 4
    assert nic.drain() == (2, T.DRAIN_CAUGHT_UP)
    assert [c["wqe_counter"] for c in qp.poll()] == [4, 5]


def test_send_queue_full_raises():
    src, dst, keys = _buffers(1 << 10)
    qp = T.QueuePair(log_wqebbs=2, log_cqes=2, qpn=1)
    for _ in range(4):
        qp.post_write(src.data_ptr(), LKEY, REMOTE_BASE, RKEY, 1)
    with pytest.raises(RuntimeError, match="send queue full"):
        qp.post_write(src.data_ptr(), LKEY, REMOTE_BASE, RKEY, 1)


def test_bad_rkey_errors_and_flushes_the_rest():
    src, dst, keys = _buffers(1 << 10)
    qp = T.QueuePair(log_wqebbs=4, log_cqes=4, qpn=1)
    nic = T.Nic(qp, keys)
    qp.post_write(src.data_ptr(), LKEY, REMOTE_BASE, RKEY, 16)
    qp.post_write(src.data_ptr(), LKEY, REMOTE_BASE + 1000, RKEY, 100)  # runs past the region
    qp.post_write(src.data_ptr(), LKEY, REMOTE_BASE + 32, RKEY, 16, signaled=False)
    qp.ring()
    nic.drain()
    comps = qp.poll()
    assert [(c["wqe_counter"], c["cqe_opcode"], c["syndrome"]) for c in comps] == [
        (0, T.CQE_REQ, 0), (1, T.CQE_REQ_ERR, T.SYNDROME_REMOTE_ACCESS), (2, T.CQE_REQ_ERR, T.SYNDROME_WR_FLUSH)]
    assert nic.error == T.SYNDROME_REMOTE_ACCESS
    assert torch.equal(dst[:16], src[:16]) and not dst[16:].any()


# ---------------------------------------------------------------- the CPU proxy


def test_cpu_proxy_end_to_end_writes_and_signals():
    n_bytes = 1 << 16
    src, dst, keys = _buffers(n_bytes, seed=3)
    counter = torch.zeros(1, dtype=torch.int64)
    fetched = torch.zeros(64, dtype=torch.int64)
    keys.add(CNT_KEY, REMOTE_BASE + (1 << 40), 8, counter.data_ptr())
    keys.add(RES_KEY, fetched.data_ptr(), fetched.numel() * 8, fetched.data_ptr())
    qp = T.QueuePair(log_wqebbs=5, log_cqes=4, qpn=0x777)
    expected = torch.zeros_like(dst)
    rng = random.Random(11)
    completions, n_fa = [], 0

    def make_room(wqebbs):
        deadline = time.monotonic() + 10
        if qp.free_wqebbs < wqebbs:
            qp.ring()  # what is still unannounced may be what has to complete
        while qp.free_wqebbs < wqebbs:
            completions.extend(qp.poll())
            assert time.monotonic() < deadline, "proxy made no progress"

    with T.CpuProxy(qp, keys) as proxy:
        for i in range(600):
            r = rng.random()
            if r < 0.1 and n_fa < fetched.numel():
                make_room(1)
                qp.post_fetch_add(fetched.data_ptr() + 8 * n_fa, RES_KEY, REMOTE_BASE + (1 << 40), CNT_KEY, n_fa + 1)
                n_fa += 1
            elif r < 0.4:
                off, n = rng.randrange(0, n_bytes - 200), rng.randint(1, 200)
                make_room(4)
                qp.post_write_inline(bytes(src[off:off + n].tolist()), REMOTE_BASE + off, RKEY, signaled=i % 3 == 0)
                expected[off:off + n] = src[off:off + n]
            else:
                off, n = rng.randrange(0, n_bytes - 4096), rng.randint(1, 4096)
                make_room(1)
                qp.post_write(src.data_ptr() + off, LKEY, REMOTE_BASE + off, RKEY, n, signaled=i % 3 == 0)
                expected[off:off + n] = src[off:off + n]
            if i % 5 == 4:
                qp.ring()
        make_room(1)
        qp.post_write(src.data_ptr(), LKEY, REMOTE_BASE, RKEY, 0)  # signaled: its CQE retires everything before it
        qp.ring()
        proxy.wait_consumed(qp.producer_index, timeout_s=10)
        completions.extend(qp.poll())
        assert proxy.queue_error == 0 and proxy.failure == ""
        assert proxy.wqes_executed == 601
    assert not proxy.running
    assert all(c["cqe_opcode"] == T.CQE_REQ and c["qpn"] == 0x777 for c in completions)
    assert qp.retired_index == qp.producer_index
    assert torch.equal(dst, expected)
    # signals: executed in posting order, each sees the sum of those before it
    adds = torch.arange(1, n_fa + 1, dtype=torch.int64)
    assert int(counter) == int(adds.sum())
    assert torch.equal(fetched[:n_fa], torch.cumsum(adds, 0) - adds)


def test_wait_doorbell_times_out_instead_of_hanging():
    qp = T.QueuePair(log_wqebbs=2, log_cqes=2, qpn=1)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="doorbell record did not move"):
        T.wait_doorbell(qp, 0, timeout_s=0.05)
    assert time.monotonic() - t0 < 2
    src, dst, keys = _buffers(64)
    qp.post_write(src.data_ptr(), LKEY, REMOTE_BASE, RKEY, 8)
    qp.ring()
    T.wait_doorbell(qp, 0, timeout_s=1)  # moved: returns at once


def test_proxy_wait_times_out_when_nothing_is_posted():
    src, dst, keys = _buffers(64)
    qp = T.QueuePair(log_wqebbs=2, log_cqes=2, qpn=1)
    with T.CpuProxy(qp, keys, poll_slice_s=0.001) as proxy:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="consumer index 0, doorbell record 0, wanted 1"):
            proxy.wait_consumed(1, timeout_s=0.05)
        assert time.monotonic() - t0 < 2
    with pytest.raises(RuntimeError, match="not running"):
        proxy.wait_consumed(1, timeout_s=0.05)


def test_proxy_reports_a_stall_when_the_cq_is_never_polled():
    src, dst, keys = _buffers(64)
    qp = T.QueuePair(log_wqebbs=3, log_cqes=1, qpn=1)
    for i in range(4):
        qp.post_write(src.data_ptr() + i, LKEY, REMOTE_BASE + i, RKEY, 1)
    qp.ring()
    with T.CpuProxy(qp, keys, stall_timeout_s=0.05) as proxy:
        with pytest.raises(RuntimeError, match="completion queue stayed full"):
            proxy.wait_consumed(qp.producer_index, timeout_s=5)
        assert proxy.consumed == 2
