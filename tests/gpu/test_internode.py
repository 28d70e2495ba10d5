"""Internode normal mode on GPUs posing as nodes (2 GPUs: 2 nodes x 1 GPU; with 4 GPUs also 2 x 2): dispatch and
combine on the CUDA backend, whose bytes between nodes travel as GPU-posted mlx5 WQEs executed by the device
emulated NIC, only between ranks of the same local index, and inside a node over NVLink peer pointers; results
against the reference backend bit for bit; the NIC's counters equal the WQEs and bytes the hierarchical route had
to post (each token once per remote node, one partial per (token, node) back); the node barrier of the NVLink hop
on 2 GPUs as one node; a missing peer gives CommTimeoutError, not a hang."""
from __future__ import annotations

import pytest
import torch

from nccl_run import gpu_count, run_on_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs with peer access")]

E, K, M = 16, 4, 128
CHUNK = 1 << 20  # deepcomm.cuda.internode.CHUNK_BYTES, restated: the test computes the WQEs independently


def _routing(gen, T, mode, device):
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    if mode == "one_expert":  # every token to expert E-1 only: all rows go to rank 1
        idx[:] = -1
        idx[:, 0] = E - 1
    if mode == "masked":
        idx[torch.rand(T, K, generator=gen) < 0.4] = -1
    return idx.to(device), torch.rand(T, K, generator=gen).to(device)


def _same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for i, (u, w) in enumerate(zip(a, b)):
            _same(u, w, f"{what}[{i}]")
        return
    if not torch.is_tensor(a):
        assert a == b, f"{what}: {a} vs {b}"
        return
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), f"{what} differs"


def _same_handle(a, b, what):
    for f in ("num_experts", "num_tokens", "hidden", "num_recv", "is_token_in_rank", "send_pos", "count_matrix",
              "recv_src_idx", "num_recv_tokens_per_expert"):
        _same(getattr(a, f), getattr(b, f), f"{what}: handle.{f}")


def _expected(round_bytes):
    """NIC totals for rounds that sent these byte counts to one peer: per round a credit and a signal fetch-add
    (8 bytes each), and one inline write for a block of 1..220 bytes, else one write WQE per started megabyte."""
    wqes = writes = nbytes = atomics = 0
    for b in round_bytes:
        n = 1 if 0 < b <= 220 else (b + CHUNK - 1) // CHUNK
        wqes += n + 2
        writes += n
        atomics += 2
        nbytes += b + 16
    return dict(wqes=wqes, bytes=nbytes, writes=writes, atomics=atomics)


def _delta(after, before):
    return {k: after[k] - before[k] for k in after}


def _row(*byte_counts):
    return (sum(byte_counts) + 15) // 16 * 16


def _internode_worker(rank, world, gpn):
    import torch.distributed as dist

    import deepcomm
    from deepcomm import layout
    from deepcomm.fp8 import per_token_cast_to_fp8
    from deepcomm.topology import Topology

    dev = torch.device("cuda", rank)
    G, N = gpn, world // gpn
    node, local = divmod(rank, G)
    peers = [m * G + local for m in range(N) if m != node]  # RDMA only to our local index on the other nodes
    mask = 4 if G > 1 else 0  # with several GPUs per node a payload row carries the node's GPU mask (int32)
    ref = deepcomm.Buffer(max_tokens_per_rank=M, hidden=7168, backend="reference", gpus_per_node=gpn, timeout_s=30)
    nic = deepcomm.Buffer(max_tokens_per_rank=M, hidden=7168, backend="cuda", gpus_per_node=gpn, timeout_s=30)
    assert nic.topology == Topology(world // gpn, gpn) and nic.backend_name == "cuda"
    backend = nic._backend
    assert type(backend).__name__ == "InternodeBackend"
    gen = torch.Generator().manual_seed(70 + rank)
    cases = [(0 if rank == 0 else 37, "random", 2880, False), (1, "random", 2880, False),
             (50, "one_expert", 2880, False), (64, "masked", 2880, False), (M, "random", 7168, False),
             (M, "masked", 7168, True), (0 if rank == 1 else 5, "random", 7168, True)]
    for T, mode, H, fp8 in cases:
        what = f"T={T} {mode} H={H} {'fp8' if fp8 else 'bf16'}"
        idx, w = _routing(gen, T, mode, dev)
        x16 = (torch.randn(T, H, generator=gen) * 3).to(torch.bfloat16).to(dev)
        x = per_token_cast_to_fp8(x16) if fp8 else x16

        before = backend.nic_totals()
        out_r = ref.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        out_n = nic.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        for i, name in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights", "per_expert")):
            _same(out_n[i], out_r[i], f"{what}: {name}")
        _same_handle(out_n[4], out_r[4], what)
        # The WQEs were real: exactly the counts round (our row of R int32, and with G > 1 our N node counts,
        # padded to 16 bytes, inline) and the payload round (one row per token that has an expert on the peer's
        # node: x [+ scales] + int64 ids + int32 source index + fp32 weights [+ node mask], padded to 16 bytes).
        in_rank = layout.token_in_rank(idx.cpu(), E, world)
        everyone = [None] * world  # every rank's routing: what we forward and reduce for our rail's sources
        dist.all_gather_object(everyone, in_rank)
        to_node = in_rank.view(T, N, G).any(dim=2).sum(dim=0).tolist()  # our tokens per node, once each
        x_bytes = H + H // 128 * 4 if fp8 else 2 * H
        after = backend.nic_totals()
        assert sorted(after) == peers, f"{what}: queue pairs to {sorted(after)}, expected the rail {peers}"
        for peer in peers:
            got = _delta(after[peer], before[peer])
            want = _expected([_row(4 * world + (4 * N if G > 1 else 0)),
                              to_node[peer // G] * _row(x_bytes, 8 * K, 4, 4 * K, mask)])
            assert got == want, f"{what}: NIC totals to {peer}: {got}, expected {want}"

        # cached re-dispatch (no ids: weights travel as given)
        x2 = (torch.randn(T, H, generator=gen)).to(torch.bfloat16).to(dev)
        x2 = per_token_cast_to_fp8(x2) if fp8 else x2
        w2 = torch.rand(T, K, generator=gen).to(dev)
        before = backend.nic_totals()
        again_r = ref.dispatch(x2, handle=out_r[4], topk_weights=w2)
        again_n = nic.dispatch(x2, handle=out_n[4], topk_weights=w2)
        for i, name in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights", "per_expert")):
            _same(again_n[i], again_r[i], f"{what}: cached {name}")
        after = backend.nic_totals()
        for peer in peers:
            got = _delta(after[peer], before[peer])
            want = _expected([to_node[peer // G] * _row(x_bytes, 4 * K, mask)])
            assert got == want, f"{what}: cached, {peer}: {got}, expected {want}"

        # combine (expert outputs and weights), then the FP8 combine where H allows it
        n = out_n[4].num_recv
        y = torch.randn(n, H, generator=gen).to(torch.bfloat16).to(dev)
        yw = torch.rand(n, K, generator=gen).to(dev)
        def combine_bytes(peer, held_row_bytes, weight_bytes):
            """One row per token of `peer` that our node holds: as held when one GPU holds it, else fp32."""
            holders = everyone[peer][:, node * G:node * G + G].sum(dim=1)
            return (int((holders == 1).sum()) * _row(held_row_bytes, weight_bytes)
                    + int((holders > 1).sum()) * _row(4 * H, weight_bytes))

        before = backend.nic_totals()
        _same(nic.combine(y, out_n[4], topk_weights=yw), ref.combine(y, out_r[4], topk_weights=yw),
              f"{what}: combine")
        after = backend.nic_totals()
        for peer in peers:  # node partials go back to their source
            got = _delta(after[peer], before[peer])
            want = _expected([combine_bytes(peer, 2 * H, 4 * K)])
            assert got == want, f"{what}: combine, {peer}: {got}, expected {want}"
        if H % 128 == 0:  # the FP8 combine needs whole 128-value blocks
            before = backend.nic_totals()
            _same(nic.combine(y, out_n[4], use_fp8=True), ref.combine(y, out_r[4], use_fp8=True),
                  f"{what}: fp8 combine")
            after = backend.nic_totals()
            for peer in peers:
                got = _delta(after[peer], before[peer])
                want = _expected([combine_bytes(peer, H + H // 128 * 4, 0)])
                assert got == want, f"{what}: fp8 combine, {peer}: {got}, expected {want}"

    # Nothing went wrong on any queue: no error CQE, the NIC consumed everything the posters published.
    for d, s in backend.transport.nic_stats().items():
        nic_rec, post = s["nic"], s["poster"]
        assert nic_rec["error"] == 0 and post["error_cqes"] == 0, s
        assert nic_rec["consumed"] == post["reserved"] == post["published"] == post["retired"], s
        assert nic_rec["cqes"] == post["cqes_seen"] == backend.nic_totals()[d]["wqes"], s
    with pytest.raises(RuntimeError, match="low-latency mode is not built"):
        backend.low_latency_dispatch()
    nic.destroy()
    ref.destroy()


def _missing_peer_worker(rank, world):
    import torch.distributed as dist

    import deepcomm
    from deepcomm.errors import CommTimeoutError

    dev = torch.device("cuda", rank)
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=256, backend="cuda", gpus_per_node=1, timeout_s=2)
    if rank == 0:  # rank 1 never dispatches: our poster waits for its credit, bounded
        idx = torch.zeros(4, 2, dtype=torch.int64, device=dev)
        x = torch.ones(4, 256, dtype=torch.bfloat16, device=dev)
        with pytest.raises(CommTimeoutError, match="internode:credit|nic:doorbell|qp:signal"):
            buf.dispatch(x, topk_idx=idx, num_experts=E)
        with pytest.raises(RuntimeError, match="destroy it"):
            buf.dispatch(x, topk_idx=idx, num_experts=E)
    dist.barrier()
    buf.destroy()


def _node_link_worker(rank, world):
    """2 GPUs as one node of the NVLink hop: 40 stages of 1 MiB puts into the peer's area between barriers, each
    checked at once (a barrier that let a read overtake the peer's put would show stale bytes), then a GPU that
    never comes to the barrier: CommTimeoutError naming the stage, and the link refuses further barriers."""
    import torch.distributed as dist

    from deepcomm._ext import load_extension
    from deepcomm.cuda.node_link import NodeLink
    from deepcomm.errors import CommTimeoutError

    dev = torch.device("cuda", rank)
    n = 1 << 20
    link = NodeLink(load_extension(), None, rank, world, world, dev, 2 * n, timeout_s=3)
    peer = 1 - rank
    base = torch.arange(n, device=dev, dtype=torch.int64).to(torch.uint8)
    for i in range(40):
        link.fence("test:free")
        link.put(peer, 0, base + (17 * i + rank))  # into the peer's area, over NVLink
        link.put(rank, n, base + (17 * i + 5))     # and into our own, past it
        link.fence("test")
        area = link.area()
        assert torch.equal(area[:n], base + (17 * i + peer)), f"stage {i}: stale or partial bytes from the peer"
        assert torch.equal(area[n:2 * n], base + (17 * i + 5)), f"stage {i}: own put"
    link.synchronize()
    dist.barrier()
    if rank == 0:
        link.fence("test:alone")
        with pytest.raises(CommTimeoutError, match="node:barrier"):
            link.synchronize()
        with pytest.raises(RuntimeError, match="destroy it"):
            link.fence("test:after")
    dist.barrier()
    link.close()


def test_node_link_barrier_2_gpus():
    run_on_gpus(_node_link_worker, 2)


def test_internode_2x1_against_reference():
    run_on_gpus(_internode_worker, 2, 1)


@pytest.mark.skipif(gpu_count() < 4, reason="2 nodes x 2 GPUs needs 4 GPUs")
def test_internode_2x2_against_reference():
    run_on_gpus(_internode_worker, 4, 2)


def test_internode_missing_peer_times_out():
    run_on_gpus(_missing_peer_worker, 2)
