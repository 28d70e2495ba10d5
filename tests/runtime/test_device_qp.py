"""Device queue pairs: GPU threads post mlx5 WQEs (same bytes as the host encoders), and a device emulated NIC
drains them with nic_drain, executing RDMA writes and fetch-add signals through NVLink peer pointers."""
from __future__ import annotations

import random

import pytest
import torch

from tests.helpers.nccl_run import gpu_count, needs_ranks, rank_device, run_on_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")]


def _ext():
    from deepcomm._ext import load_extension
    C = load_extension()
    if C is None:
        pytest.skip("deepcomm._C is not built")
    return C


def _selftest():
    from deepcomm._ext import load_selftest, selftest_error
    S = load_selftest()
    if S is None:
        pytest.skip(f"the test-only module deepcomm._selftest is not available ({selftest_error()})")
    return S


def _wqebbs_of(kind, nbytes):
    if kind != "inline":
        return 1
    ds = 2 + (4 + nbytes + 15) // 16
    return (ds + 3) // 4


def _host_ring(T, log_wqebbs, qpn, index, s):
    """The host encoder's ring for spec s placed at WQE index `index`."""
    if s["kind"] in ("write", "write_imm"):
        return T.encode_rdma_write(log_wqebbs, qpn, index, s["laddr"], s["lkey"], s["raddr"], s["rkey"], s["bytes"],
                                   s["fm_ce_se"], s["signature"], s["imm"], s["kind"] == "write_imm")
    if s["kind"] == "fetch_add":
        return T.encode_fetch_add(log_wqebbs, qpn, index, s["laddr"], s["lkey"], s["raddr"], s["rkey"], s["add"],
                                  s["fm_ce_se"], s["signature"])
    return T.encode_rdma_write_inline(log_wqebbs, qpn, index, s["payload_bytes"], s["raddr"], s["rkey"], s["fm_ce_se"])


def _slots(ring, index, n, log_wqebbs):
    size = 1 << log_wqebbs
    return b"".join(ring[((index + k) % size) * 64:((index + k) % size + 1) * 64] for k in range(n))


def test_gpu_posted_wqes_equal_host_encoder():
    """120 GPU threads post at once, starting 100 WQEBBs before the 16-bit index wrap and across the ring's end;
    every WQE's WQEBBs, the doorbell record and the doorbell register equal the host encoders' bytes."""
    from deepcomm.internode.device_qp import DeviceQueuePair
    C = _ext()
    T = C.transport
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    rng = random.Random(5)
    log_wqebbs, qpn, start = 8, 0xABCDE, 65536 - 100
    payload = torch.randint(0, 256, (120 * 256,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    payload_dev = payload.to(dev)
    specs = []
    for i in range(120):
        kind = rng.choice(["write", "write_imm", "fetch_add", "inline"])
        fm = rng.choice([0, T.CTRL_CQ_UPDATE, T.CTRL_CQ_UPDATE | T.CTRL_SOLICITED, T.CTRL_FENCE])
        s = dict(kind=kind, fm_ce_se=fm, signature=0, imm=0, laddr=rng.getrandbits(64), lkey=rng.getrandbits(32),
                 raddr=rng.getrandbits(64), rkey=rng.getrandbits(32), bytes=rng.randrange(1, 1 << 31), add=0)
        if kind in ("write", "write_imm"):
            s["signature"], s["imm"] = rng.getrandbits(8), rng.getrandbits(32)
        if kind == "fetch_add":
            s["add"], s["bytes"] = rng.getrandbits(64), 8
        if kind == "inline":
            s["bytes"] = rng.choice([0, 1, 11, 12, 13, 27, 28, 60, 123, 219, 220])
            s["payload"] = payload_dev.data_ptr() + 256 * i
            s["payload_bytes"] = bytes(payload[256 * i:256 * i + s["bytes"]].numpy().tobytes())
        specs.append(s)
    total = sum(_wqebbs_of(s["kind"], s["bytes"]) for s in specs)
    assert 100 < total <= 1 << log_wqebbs  # crosses the 16-bit wrap; fits without a NIC

    qp = DeviceQueuePair(C, dev, log_wqebbs=log_wqebbs, qpn=qpn, start=start, timeout_s=5)
    torch.cuda.synchronize(dev)
    indices = _selftest().qp_encode_selftest(qp.ptr, log_wqebbs, qp.log_cqes, qpn, specs, qp.err_dev, 5.0, qp.seq.data_ptr())
    qp.check_error()

    # Reservations are contiguous and disjoint, whatever order the threads got them in.
    order = sorted(range(len(specs)), key=lambda i: indices[i])
    expect = start
    for i in order:
        assert indices[i] == expect, f"WQE {i}: index {indices[i]}, expected {expect}"
        expect += _wqebbs_of(specs[i]["kind"], specs[i]["bytes"])
    end = start + total
    assert expect == end

    ring = qp.ring_bytes()
    for i, s in enumerate(specs):
        n = _wqebbs_of(s["kind"], s["bytes"])
        host = _host_ring(T, log_wqebbs, qpn, indices[i], s)
        assert _slots(ring, indices[i], n, log_wqebbs) == _slots(host, indices[i], n, log_wqebbs), \
            f"WQE {i} ({s['kind']}) at index {indices[i]} differs from the host encoder"
        d = T.decode_wqe(ring, indices[i] % (1 << 16))
        assert d["status"] == 0 and d["qpn"] == qpn and d["wqe_index"] == indices[i] & 0xFFFF
        if s["kind"] == "inline":
            assert d["payload"] == s["payload_bytes"]

    dbrec = qp.dbrec_bytes()
    assert dbrec[:4] == bytes(4) and dbrec[4:] == (end & 0xFFFF).to_bytes(4, "big")
    assert int.from_bytes(dbrec[4:], "little") == T.dbrec_value(end)
    assert qp.doorbell_bytes() == T.doorbell_value(end, qpn).to_bytes(8, "little")
    st = qp.poster_state()
    assert (st["reserved"], st["published"], st["retired"]) == (end, end, start)
    qp.close()


def test_full_send_queue_without_completions_times_out():
    """Nothing drains a 4-WQEBB ring: the fifth post waits for room and gives CommTimeoutError (qp:room)."""
    from deepcomm.internode.device_qp import DeviceQueuePair
    from deepcomm.errors import CommTimeoutError
    C = _ext()
    T = C.transport
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    qp = DeviceQueuePair(C, dev, log_wqebbs=2, timeout_s=0.5)
    torch.cuda.synchronize(dev)
    specs = [dict(kind="write", fm_ce_se=T.CTRL_CQ_UPDATE, laddr=64 * i, lkey=1, raddr=0, rkey=2, bytes=64)
             for i in range(6)]
    indices = _selftest().qp_encode_selftest(qp.ptr, 2, qp.log_cqes, qp.qpn, specs, qp.err_dev, 0.5, qp.seq.data_ptr())
    assert sorted(i for i in indices if i != 0xFFFFFFFF) == [0, 1, 2, 3]
    with pytest.raises(CommTimeoutError, match="qp:room"):
        qp.check_error()
    assert qp.poster_state()["published"] == 4
    qp.close()


def _area_offsets(channels, messages, slot):
    def up(n):
        return (n + 255) // 256 * 256
    area = channels * messages * slot
    o = {"src": 0, "recv": up(area)}
    o["counters"] = o["recv"] + up(area)
    o["fa_old"] = o["counters"] + up(channels * 8)
    o["done"] = o["fa_old"] + up(channels * messages * 8)
    o["mismatches"] = o["done"] + 256
    o["total"] = o["mismatches"] + 256
    return area, o


def _traffic_worker(rank, world, channels, messages, slot, inline_every, log_wqebbs, start, nic_extra):
    import torch.distributed as dist

    from deepcomm.cuda.arena import as_device_bytes
    from deepcomm.internode.device_qp import DeviceQueuePair
    from deepcomm.cuda.peer_memory import PeerMemory
    from deepcomm.errors import CommTimeoutError
    C = _ext()
    T = C.transport
    dev = rank_device(rank)
    peer = (rank + 1) % world  # world 1: loopback through our own NIC
    area, o = _area_offsets(channels, messages, slot)
    mem = PeerMemory(C, None, rank, world, o["total"])
    buf = as_device_bytes(mem.ptr, o["total"], dev, owner=mem)

    def src_of(r):
        return torch.randint(0, 256, (area,), dtype=torch.uint8, generator=torch.Generator().manual_seed(77 + r))

    buf[o["src"]:o["src"] + area].copy_(src_of(rank).to(dev))
    torch.cuda.synchronize(dev)
    bases = [None] * world
    dist.all_gather_object(bases, mem.ptr)  # each rank's own address of its buffer: what WQEs name remotely
    lkey, rkey = 0x1000 + rank, 0x2000 + peer
    keys = T.KeyTable()
    keys.add(lkey, mem.ptr, o["total"], mem.ptr)
    keys.add(rkey, bases[peer], o["total"], mem.peer_ptrs[peer])  # the remote node's memory, over NVLink

    timeout_s = 1.0 if nic_extra else 20.0
    qp = DeviceQueuePair(C, dev, log_wqebbs=log_wqebbs, qpn=0x400 + rank, start=start, timeout_s=timeout_s, rank=rank)
    torch.cuda.synchronize(dev)
    dist.barrier()  # every rank's source bytes are in place before any NIC reads them
    args = dict(qp_base=qp.ptr, log_wqebbs=log_wqebbs, log_cqes=qp.log_cqes, qpn=qp.qpn, start=start,
                channels=channels, messages=messages, slot_bytes=slot, inline_every=inline_every, lkey=lkey,
                rkey=rkey, local_src_addr=mem.ptr + o["src"], local_fa_old_addr=mem.ptr + o["fa_old"],
                remote_recv_addr=bases[peer] + o["recv"], remote_counter_addr=bases[peer] + o["counters"],
                peer_src=mem.peer_ptrs[peer] + o["src"], recv=mem.ptr + o["recv"], counters=mem.ptr + o["counters"],
                posters_done=mem.ptr + o["done"], nic_stop_target=channels + nic_extra,
                mismatches=mem.ptr + o["mismatches"])
    _selftest().qp_traffic(args, keys, qp.err_dev, timeout_s, rank, qp.seq.data_ptr(), peer,
                 torch.cuda.current_stream(dev).cuda_stream)
    torch.cuda.synchronize(dev)
    if nic_extra:
        with pytest.raises(CommTimeoutError, match="nic:doorbell"):
            qp.check_error()
        assert qp.nic_stats()["stopped"] == 1
    else:
        qp.check_error()

    # What arrived: every message's bytes, nothing past them, the signal counts, and the fetch-add results.
    host = buf.cpu()
    mism = int(host[o["mismatches"]:o["mismatches"] + 4].view(torch.int32)[0])
    assert mism == 0, f"{mism} messages were signalled before their bytes arrived"
    peer_src = src_of(peer).view(channels, messages, slot)
    recv = host[o["recv"]:o["recv"] + area].view(channels, messages, slot)
    sizes = [[_selftest().qp_test_message_bytes(c, m, slot, inline_every) for m in range(messages)] for c in range(channels)]
    for c in range(channels):
        for m in range(messages):
            n = sizes[c][m]
            assert torch.equal(recv[c, m, :n], peer_src[c, m, :n]), f"channel {c} message {m}: data differs"
            assert not recv[c, m, n:].any(), f"channel {c} message {m}: bytes written past {n}"
    counters = host[o["counters"]:o["counters"] + channels * 8].view(torch.int64)
    assert counters.tolist() == [messages] * channels
    fa_old = host[o["fa_old"]:o["fa_old"] + channels * messages * 8].view(torch.int64).view(channels, messages)
    assert torch.equal(fa_old, torch.arange(messages).expand(channels, messages)), "fetch-add results out of order"

    # The queue: every WQEBB posted, published, completed and consumed; one CQE per signal, all good.
    total = sum(1 + (_wqebbs_of("inline", sizes[c][m]) if _selftest().qp_test_is_inline(m, inline_every) else 1)
                for c in range(channels) for m in range(messages))
    end = (start + total) % (1 << 32)
    assert total >= 4 * qp.wqebbs, "the test must wrap the ring several times"
    st, nic = qp.poster_state(), qp.nic_stats()
    assert (st["reserved"], st["published"], st["retired"]) == (end, end, end), st
    assert (st["cqes_seen"], st["error_cqes"]) == (channels * messages, 0), st
    assert nic == dict(consumed=end, wqes=2 * channels * messages, cqes=channels * messages, error=0, stopped=1), nic
    assert qp.dbrec_bytes()[4:] == (end & 0xFFFF).to_bytes(4, "big")
    assert qp.doorbell_bytes() == T.doorbell_value(end, qp.qpn).to_bytes(8, "little")
    last = channels * messages - 1  # the last CQE: a fetch-add (opcode 0x12), requester, owner bit of its pass
    cqe = qp.cqe_bytes(last)
    assert cqe[63] >> 4 == T.CQE_REQ and cqe[63] & 1 == (last >> qp.log_cqes) & 1
    assert int.from_bytes(cqe[56:60], "big") == (T.OP_ATOMIC_FA << 24) | qp.qpn
    assert int.from_bytes(cqe[44:48], "big") == 8

    dist.barrier()  # the peer's NIC is done with our memory
    qp.close()
    mem.close()


# (channels, messages, slot bytes, inline every, log_wqebbs, start): start sits before the 16-bit index wrap.
TRAFFIC = (8, 300, 1000, 3, 6, 65536 - 1500)


@needs_ranks(2)
def test_two_gpus_post_through_device_nic():
    """Each rank's GPU threads post writes, inline writes and fetch-add signals; its device NIC executes them into
    the other GPU over NVLink. Signals count exactly, arrive after their data, and CQEs retire the ring ~80 times."""
    run_on_gpus(_traffic_worker, 2, *TRAFFIC, 0, timeout_s=240)


def test_one_gpu_loopback_through_device_nic():
    """One GPU plays both nodes; indices start just before the 32-bit wrap of the free-running counters."""
    run_on_gpus(_traffic_worker, 1, 4, 200, 700, 5, 6, 2**32 - 300, 0, timeout_s=240)


def test_device_nic_waiting_for_absent_poster_times_out():
    """The NIC is told to wait for one poster more than there are: CommTimeoutError naming nic:doorbell, after
    every real message was delivered."""
    run_on_gpus(_traffic_worker, 1, 2, 50, 300, 4, 5, 0, 1, timeout_s=240)
