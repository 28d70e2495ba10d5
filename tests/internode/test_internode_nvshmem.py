"""Internode normal mode over the NVSHMEM transport (internode_transport="nvshmem-host") on 2 GPUs posed as 2 nodes x 1
GPU (with 4 GPUs also 2 x 2): the hierarchical routing (hier_normal.py) with its RDMA hop as NVSHMEM puts-with-
signal (or lone signals) on the symmetric heap, only between ranks of the same local index, and its NVLink hop
inside a node; every wait a bounded deepcomm kernel. Dispatch (BF16, FP8, with weights), cached re-dispatch and
combine equal the reference backend bit for bit; the calls each round issued equal what the hierarchical route had
to send (each token once per remote node, one partial per (token, node) back); a missing peer gives
CommTimeoutError at the credit stage, and a peer that frees its slot but never sends, at the signal stage."""
from __future__ import annotations

import os
import time

import pytest
import torch

from tests.helpers.nccl_run import has_nvshmem_wheel, needs_ranks, rank_device, reference, run_on_gpus
from tests.helpers.internode_cases import E, M, check_cases


pytestmark = [pytest.mark.gpu, needs_ranks(2),
              pytest.mark.skipif(not has_nvshmem_wheel(),
                                 reason="nvidia.nvshmem is not importable (pip install nvidia-nvshmem-cu13)")]


def _expected(round_bytes):
    """What one rank issues to one peer for rounds that sent it these byte counts: per round a credit signal,
    then a put-with-signal, or a lone signal for an empty block."""
    return dict(credits=len(round_bytes), puts=sum(1 for b in round_bytes if b), signals=sum(1 for b in round_bytes
                                                                                                if not b),
                bytes=sum(round_bytes))


def _nvshmem_worker(rank, world, gpn):
    import deepcomm
    from deepcomm.cuda import nvshmem_session as ns
    from deepcomm.internode.nvshmem_transport import NvshmemTransport
    from deepcomm.topology import Topology

    G, N = gpn, world // gpn
    node, local = divmod(rank, G)
    peers = [m * G + local for m in range(N) if m != node]  # NVSHMEM calls only to our local index elsewhere
    ref = reference(rank_device(rank), max_tokens_per_rank=M, hidden=7168, gpus_per_node=gpn, timeout_s=30)
    nv = deepcomm.Buffer(max_tokens_per_rank=M, hidden=7168, backend="cuda", gpus_per_node=gpn, timeout_s=30,
                         internode_transport="nvshmem-host")
    assert nv.topology == Topology(world // gpn, gpn) and nv.backend_name == "cuda"
    assert nv.config.internode_transport == "nvshmem-host"
    backend = nv._backend
    tr = backend.transport
    assert type(backend).__name__ == "InternodeBackend" and isinstance(tr, NvshmemTransport), type(tr)
    assert tr.peers == peers and sorted(tr.transfer_totals()) == peers, (tr.peers, peers)
    assert ns.current() is not None and ns.current().how == "torch.distributed"
    check_cases(rank, world, gpn, nv, ref, tr.transfer_totals, _expected, "NVSHMEM calls")

    # Every round's signal and credit from every rail peer arrived (SET to the round number), nothing more, and
    # nothing from a rank that is not a rail peer.
    signal, credit = tr.counters("signal"), tr.counters("credit")
    for p in range(world):
        want = tr.round if p in peers else 0
        assert p == rank or (signal[p] == want and credit[p] == want), \
            f"rank {rank}: after {tr.round} rounds, signal {signal}, credit {credit} (peer {p})"
    assert backend.nic_totals() == {} and nv.size_bytes() == tr.region_bytes + backend.link.mem.nbytes
    nv.set_num_sms(8)  # accepted, changes nothing
    nv.destroy()
    ref.destroy()
    ns.finalize()


def _missing_peer_worker(rank, world):
    os.environ["DEEPCOMM_INTERNODE_TRANSPORT"] = "nvshmem-host"  # selected through the environment this time
    import torch.distributed as dist

    import deepcomm
    from deepcomm.cuda import nvshmem_session as ns
    from deepcomm.internode.internode_rows import RAIL_HEADER_BYTES
    from deepcomm.internode.nvshmem_transport import NvshmemTransport, credit_ops
    from deepcomm.errors import CommTimeoutError

    dev = rank_device(rank)
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
        # the count row: the call's words (RAIL_HEADER_BYTES), then 16 bytes of counts
        assert tr.transfer_totals()[1] == dict(credits=1, puts=1, signals=0, bytes=RAIL_HEADER_BYTES + 16), \
            tr.transfer_totals()
    dist.barrier()
    if rank == 1:  # rank 0's counts block (16 bytes) and its signal did land here
        assert tr.counters("signal")[0] == 1 and tr.counters("credit")[0] == 1, (tr.counters("signal"),
                                                                                 tr.counters("credit"))
        words = RAIL_HEADER_BYTES // 4
        got = tr.recv_view(0, 1, RAIL_HEADER_BYTES + 16).view(torch.int32)[0, words:words + world].tolist()
        assert got == [4, 0], f"rank 0's tokens per rank as received: {got}"
    dist.barrier()
    buf.destroy()
    ns.finalize()


def test_internode_nvshmem_2x1_against_reference():
    run_on_gpus(_nvshmem_worker, 2, 1, timeout_s=400)


@pytest.mark.parametrize("nodes, gpn", [pytest.param(2, 2, marks=needs_ranks(4, "2 nodes x 2 GPUs")),
                                        pytest.param(2, 4, marks=needs_ranks(8, "2 nodes x 4 GPUs")),
                                        pytest.param(4, 2, marks=needs_ranks(8, "4 nodes x 2 GPUs"))])
def test_internode_nvshmem_several_gpus_per_node_against_reference(nodes, gpn):
    run_on_gpus(_nvshmem_worker, nodes * gpn, gpn, timeout_s=400)


def test_internode_nvshmem_missing_peer_times_out():
    run_on_gpus(_missing_peer_worker, 2, timeout_s=240)
