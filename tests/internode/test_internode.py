"""Internode normal mode on GPUs posing as nodes (2 GPUs: 2 nodes x 1 GPU; with 4 GPUs also 2 x 2; with 8 also
2 x 4 and 4 x 2; in shared mode, docs/testing.md, the ranks of each pose share one GPU): dispatch and
combine on the CUDA backend, whose bytes between nodes travel as GPU-posted mlx5 WQEs executed by the device
emulated NIC, only between ranks of the same local index, and inside a node over NVLink peer pointers; results
against the reference backend bit for bit; the NIC's counters equal the WQEs and bytes the hierarchical route had
to post (each token once per remote node, one partial per (token, node) back); the node barrier of the NVLink hop
on 2 GPUs as one node; a missing peer gives CommTimeoutError, not a hang."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.internode_cases import E, M, check_bad_ids, check_cases
from tests.helpers.nccl_run import needs_ranks, rank_device, reference, run_on_gpus

pytestmark = [pytest.mark.gpu, needs_ranks(2)]

CHUNK = 1 << 20  # deepcomm.internode.nic_transport.CHUNK_BYTES, restated: the test computes the WQEs independently


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


def _internode_worker(rank, world, gpn):
    import deepcomm
    from deepcomm.topology import Topology

    ref = reference(rank_device(rank), max_tokens_per_rank=M, hidden=7168, gpus_per_node=gpn, timeout_s=30)
    nic = deepcomm.Buffer(max_tokens_per_rank=M, hidden=7168, backend="cuda", gpus_per_node=gpn, timeout_s=30)
    assert nic.topology == Topology(world // gpn, gpn) and nic.backend_name == "cuda"
    backend = nic._backend
    assert type(backend).__name__ == "InternodeBackend"
    check_cases(rank, world, gpn, nic, ref, backend.nic_totals, _expected, "NIC totals")

    # Nothing went wrong on any queue: no error CQE, the NIC consumed everything the posters published.
    for d, s in backend.transport.nic_stats().items():
        nic_rec, post = s["nic"], s["poster"]
        assert nic_rec["error"] == 0 and post["error_cqes"] == 0, s
        assert nic_rec["consumed"] == post["reserved"] == post["published"] == post["retired"], s
        assert nic_rec["cqes"] == post["cqes_seen"] == backend.nic_totals()[d]["wqes"], s
    check_bad_ids(rank, world, nic, ref)
    nic.destroy()
    ref.destroy()


def _missing_peer_worker(rank, world):
    import torch.distributed as dist

    import deepcomm
    from deepcomm.errors import CommTimeoutError

    dev = rank_device(rank)
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
    from deepcomm.internode.node_link import NodeLink
    from deepcomm.errors import CommTimeoutError

    dev = rank_device(rank)
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


@pytest.mark.parametrize("nodes, gpn", [pytest.param(2, 2, marks=needs_ranks(4, "2 nodes x 2 GPUs")),
                                        pytest.param(2, 4, marks=needs_ranks(8, "2 nodes x 4 GPUs")),
                                        pytest.param(4, 2, marks=needs_ranks(8, "4 nodes x 2 GPUs"))])
def test_internode_several_gpus_per_node_against_reference(nodes, gpn):
    run_on_gpus(_internode_worker, nodes * gpn, gpn)


def test_internode_missing_peer_times_out():
    run_on_gpus(_missing_peer_worker, 2)
