"""Internode normal mode over the NVSHMEM transport (internode_transport="nvshmem") on 2 GPUs posed as 2 nodes x 1
GPU (with 4 GPUs also 2 x 2): the hierarchical routing (hier_normal.py) with its RDMA hop as NVSHMEM puts-with-
signal (or lone signals) on the symmetric heap, only between ranks of the same local index, and its NVLink hop
inside a node; every wait a bounded deepcomm kernel. Dispatch (BF16, FP8, with weights), cached re-dispatch and
combine equal the reference backend bit for bit; the calls each round issued equal what the hierarchical route had
to send (each token once per remote node, one partial per (token, node) back); a missing peer gives
CommTimeoutError at the credit stage, and a peer that frees its slot but never sends, at the signal stage."""
from __future__ import annotations

import importlib.util
import os
import time

import pytest
import torch

from nccl_run import gpu_count, run_on_gpus
from test_internode import E, K, M, _routing, _row, _same, _same_handle


def _has_wheel() -> bool:
    try:
        return importlib.util.find_spec("nvidia.nvshmem") is not None
    except ImportError:  # no `nvidia` namespace package at all
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs with peer access"),
              pytest.mark.skipif(not _has_wheel(),
                                 reason="nvidia.nvshmem is not importable (pip install nvidia-nvshmem-cu13)")]


def _expected(round_bytes):
    """What one rank issues to one peer for rounds that sent it these byte counts: per round a credit signal,
    then a put-with-signal, or a lone signal for an empty block."""
    return dict(credits=len(round_bytes), puts=sum(1 for b in round_bytes if b), signals=sum(1 for b in round_bytes
                                                                                                if not b),
                bytes=sum(round_bytes))


def _delta(after, before):
    return {k: after[k] - before[k] for k in after}


def _nvshmem_worker(rank, world, gpn):
    import torch.distributed as dist

    import deepcomm
    from deepcomm import layout
    from deepcomm.cuda import nvshmem_session as ns
    from deepcomm.cuda.nvshmem_transport import NvshmemTransport
    from deepcomm.fp8 import per_token_cast_to_fp8
    from deepcomm.topology import Topology

    dev = torch.device("cuda", rank)
    G, N = gpn, world // gpn
    node, local = divmod(rank, G)
    peers = [m * G + local for m in range(N) if m != node]  # NVSHMEM calls only to our local index elsewhere
    mask = 4 if G > 1 else 0  # with several GPUs per node a payload row carries the node's GPU mask (int32)
    ref = deepcomm.Buffer(max_tokens_per_rank=M, hidden=7168, backend="reference", gpus_per_node=gpn, timeout_s=30)
    nv = deepcomm.Buffer(max_tokens_per_rank=M, hidden=7168, backend="cuda", gpus_per_node=gpn, timeout_s=30,
                         internode_transport="nvshmem")
    assert nv.topology == Topology(world // gpn, gpn) and nv.backend_name == "cuda"
    assert nv.config.internode_transport == "nvshmem"
    backend = nv._backend
    tr = backend.transport
    assert type(backend).__name__ == "InternodeBackend" and isinstance(tr, NvshmemTransport), type(tr)
    assert tr.peers == peers and sorted(tr.transfer_totals()) == peers, (tr.peers, peers)
    assert ns.current() is not None and ns.current().how == "torch.distributed"
    gen = torch.Generator().manual_seed(70 + rank)
    cases = [(0 if rank == 0 else 37, "random", 2880, False), (1, "random", 2880, False),
             (50, "one_expert", 2880, False), (64, "masked", 2880, False), (M, "random", 7168, False),
             (M, "masked", 7168, True), (0 if rank == 1 else 5, "random", 7168, True)]
    for T, mode, H, fp8 in cases:
        what = f"rank {rank}, T={T} {mode} H={H} {'fp8' if fp8 else 'bf16'}"
        idx, w = _routing(gen, T, mode, dev)
        x16 = (torch.randn(T, H, generator=gen) * 3).to(torch.bfloat16).to(dev)
        x = per_token_cast_to_fp8(x16) if fp8 else x16

        before = tr.transfer_totals()
        out_r = ref.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        out_n = nv.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        for i, name in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights", "per_expert")):
            _same(out_n[i], out_r[i], f"{what}: {name}")
        _same_handle(out_n[4], out_r[4], what)
        # a counts round (our row of R int32, and with G > 1 our N node counts, padded to 16 bytes) and a payload
        # round (one row per token that has an expert on the peer's node: x [+ scales] + int64 ids + int32 source
        # index + fp32 weights [+ node mask], padded to 16 bytes)
        in_rank = layout.token_in_rank(idx.cpu(), E, world)
        everyone = [None] * world  # every rank's routing: what we forward and reduce for our rail's sources
        dist.all_gather_object(everyone, in_rank)
        to_node = in_rank.view(T, N, G).any(dim=2).sum(dim=0).tolist()  # our tokens per node, once each
        x_bytes = H + H // 128 * 4 if fp8 else 2 * H
        after = tr.transfer_totals()
        for peer in peers:
            got = _delta(after[peer], before[peer])
            want = _expected([_row(4 * world + (4 * N if G > 1 else 0)),
                              to_node[peer // G] * _row(x_bytes, 8 * K, 4, 4 * K, mask)])
            assert got == want, f"{what}: NVSHMEM calls to {peer}: {got}, expected {want}"

        # cached re-dispatch (no ids: weights travel as given)
        x2 = (torch.randn(T, H, generator=gen)).to(torch.bfloat16).to(dev)
        x2 = per_token_cast_to_fp8(x2) if fp8 else x2
        w2 = torch.rand(T, K, generator=gen).to(dev)
        before = tr.transfer_totals()
        again_r = ref.dispatch(x2, handle=out_r[4], topk_weights=w2)
        again_n = nv.dispatch(x2, handle=out_n[4], topk_weights=w2)
        for i, name in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights", "per_expert")):
            _same(again_n[i], again_r[i], f"{what}: cached {name}")
        after = tr.transfer_totals()
        for peer in peers:
            got = _delta(after[peer], before[peer])
            want = _expected([to_node[peer // G] * _row(x_bytes, 4 * K, mask)])
            assert got == want, f"{what}: cached, NVSHMEM calls to {peer}: {got}, expected {want}"

        # combine (expert outputs and weights), then the FP8 combine where H allows it
        n = out_n[4].num_recv
        y = torch.randn(n, H, generator=gen).to(torch.bfloat16).to(dev)
        yw = torch.rand(n, K, generator=gen).to(dev)
        def combine_bytes(peer, held_row_bytes, weight_bytes):
            """One row per token of `peer` that our node holds: as held when one GPU holds it, else fp32."""
            holders = everyone[peer][:, node * G:node * G + G].sum(dim=1)
            return (int((holders == 1).sum()) * _row(held_row_bytes, weight_bytes)
                    + int((holders > 1).sum()) * _row(4 * H, weight_bytes))

        before = tr.transfer_totals()
        _same(nv.combine(y, out_n[4], topk_weights=yw), ref.combine(y, out_r[4], topk_weights=yw),
              f"{what}: combine")
        after = tr.transfer_totals()
        for peer in peers:  # node partials go back to their source
            got = _delta(after[peer], before[peer])
            want = _expected([combine_bytes(peer, 2 * H, 4 * K)])
            assert got == want, f"{what}: combine, NVSHMEM calls to {peer}: {got}, expected {want}"
        if H % 128 == 0:  # the FP8 combine needs whole 128-value blocks
            before = tr.transfer_totals()
            _same(nv.combine(y, out_n[4], use_fp8=True), ref.combine(y, out_r[4], use_fp8=True),
                  f"{what}: fp8 combine")
            after = tr.transfer_totals()
            for peer in peers:
                got = _delta(after[peer], before[peer])
                want = _expected([combine_bytes(peer, H + H // 128 * 4, 0)])
                assert got == want, f"{what}: fp8 combine, NVSHMEM calls to {peer}: {got}, expected {want}"

    # Every round's signal and credit from every rail peer arrived (SET to the round number), nothing more, and
    # nothing from a rank that is not a rail peer.
    signal, credit = tr.counters("signal"), tr.counters("credit")
    for p in range(world):
        want = tr.round if p in peers else 0
        assert p == rank or (signal[p] == want and credit[p] == want), \
            f"rank {rank}: after {tr.round} rounds, signal {signal}, credit {credit} (peer {p})"
    assert backend.nic_totals() == {} and nv.size_bytes() == tr.region_bytes + backend.link.mem.nbytes
    nv.set_num_sms(8)  # accepted, changes nothing
    with pytest.raises(RuntimeError, match="low-latency mode is not built"):
        backend.low_latency_dispatch()
    nv.destroy()
    ref.destroy()
    ns.finalize()


def _missing_peer_worker(rank, world):
    os.environ["DEEPCOMM_INTERNODE_TRANSPORT"] = "nvshmem"  # selected through the environment this time
    import torch.distributed as dist

    import deepcomm
    from deepcomm.cuda import nvshmem_session as ns
    from deepcomm.cuda.nvshmem_transport import NvshmemTransport, credit_ops
    from deepcomm.errors import CommTimeoutError

    dev = torch.device("cuda", rank)
    idx = torch.zeros(4, 2, dtype=torch.int64, device=dev)  # every token to expert 0 (rank 0)
    x = torch.ones(4, 256, dtype=torch.bfloat16, device=dev)
    nothing = dict(credits=0, puts=0, signals=0, bytes=0)

    # 1. rank 1 never calls: rank 0 waits for its credit, bounded, and writes nothing into it
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=256, backend="cuda", gpus_per_node=1, timeout_s=2)
    tr = buf._backend.transport
    assert isinstance(tr, NvshmemTransport), type(tr)
    if rank == 0:
        t0 = time.monotonic()
        with pytest.raises(CommTimeoutError) as info:
            buf.dispatch(x, topk_idx=idx, num_experts=E)
        e = info.value
        assert (e.rank, e.peer) == (0, 1) and e.stage.startswith("nvshmem:credit"), str(e)
        assert time.monotonic() - t0 < 60, f"took {time.monotonic() - t0:.1f} s with timeout_s=2"
        assert tr.transfer_totals()[1] == dict(nothing, credits=1), tr.transfer_totals()
        with pytest.raises(RuntimeError, match="destroy it"):
            buf.dispatch(x, topk_idx=idx, num_experts=E)
    dist.barrier()
    buf.destroy()

    # 2. rank 1 frees its slot for round 1 (the first half of a round) and stops: rank 0's block goes out, and
    # its wait for rank 1's block gives up
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=256, backend="cuda", gpus_per_node=1, timeout_s=2)
    tr = buf._backend.transport
    if rank == 1:
        with torch.cuda.device(dev):
            tr._issue(credit_ops(tr.base, tr.offsets, rank, world, 1), torch.cuda.current_stream(dev).cuda_stream)
            torch.cuda.synchronize(dev)
    dist.barrier()
    if rank == 0:
        with pytest.raises(CommTimeoutError) as info:
            buf.dispatch(x, topk_idx=idx, num_experts=E)
        e = info.value
        assert (e.rank, e.peer) == (0, 1) and e.stage.startswith("nvshmem:signal"), str(e)
        assert tr.transfer_totals()[1] == dict(credits=1, puts=1, signals=0, bytes=16), tr.transfer_totals()
    dist.barrier()
    if rank == 1:  # rank 0's counts block (16 bytes) and its signal did land here
        assert tr.counters("signal")[0] == 1 and tr.counters("credit")[0] == 1, (tr.counters("signal"),
                                                                                 tr.counters("credit"))
        got = tr.recv_view(0, 1, 16).view(torch.int32)[0, :world].tolist()
        assert got == [4, 0], f"rank 0's tokens per rank as received: {got}"
    dist.barrier()
    buf.destroy()
    ns.finalize()


def test_internode_nvshmem_2x1_against_reference():
    run_on_gpus(_nvshmem_worker, 2, 1, timeout_s=400)


@pytest.mark.skipif(gpu_count() < 4, reason="2 nodes x 2 GPUs needs 4 GPUs")
def test_internode_nvshmem_2x2_against_reference():
    run_on_gpus(_nvshmem_worker, 4, 2, timeout_s=400)


def test_internode_nvshmem_missing_peer_times_out():
    run_on_gpus(_missing_peer_worker, 2, timeout_s=240)
