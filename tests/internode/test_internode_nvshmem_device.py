"""Internode normal mode over NVSHMEM device puts (internode_transport="nvshmem": the internode kernels of
deepcomm._nvshmem_kernels issue chunked put-with-signal; csrc/kernels/hier_nvshmem_poster.cuh) on 2 GPUs posed as
2 nodes x 1 GPU, and 2 x 2 on 4 ranks (one shared GPU included, DEEPCOMM_TEST_SHARED_GPU=1 under MPS): every case
of test_internode.py bit for bit against the reference, the rounds per call, the signal and credit words, and a
peer that never comes giving CommTimeoutError naming rank, peer and an NVSHMEM stage."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.internode_cases import E, M, check_bad_ids, check_cases
from tests.helpers.nccl_run import has_nvshmem_wheel, needs_ranks, rank_device, reference, run_on_gpus


def _device_module_built() -> bool:
    import importlib.util
    return importlib.util.find_spec("deepcomm._nvshmem_kernels") is not None


pytestmark = [pytest.mark.gpu, needs_ranks(2),
              pytest.mark.skipif(not has_nvshmem_wheel(),
                                 reason="nvidia.nvshmem is not importable (pip install nvidia-nvshmem-cu13)"),
              pytest.mark.skipif(not _device_module_built(),
                                 reason="deepcomm._nvshmem_kernels is not built (NVSHMEM device library at build time)")]


def _rounds(round_bytes):
    """A call makes one exchange round per block list entry: the count round of a fresh dispatch (issued from the
    GPU, rail_round) and one kernel round; a cached dispatch and a combine one kernel round."""
    return {"rounds": len(round_bytes)}


def _device_worker(rank, world, gpn):
    import deepcomm
    from deepcomm.cuda import nvshmem_session as ns
    from deepcomm.internode.nvshmem_transport import NvshmemTransport

    G, N = gpn, world // gpn
    node, local = divmod(rank, G)
    peers = [m * G + local for m in range(N) if m != node]
    ref = reference(rank_device(rank), max_tokens_per_rank=M, hidden=7168, gpus_per_node=gpn, timeout_s=30)
    nv = deepcomm.Buffer(max_tokens_per_rank=M, hidden=7168, backend="cuda", gpus_per_node=gpn, timeout_s=30,
                         internode_transport="nvshmem")
    backend = nv._backend
    tr = backend.transport
    assert type(backend).__name__ == "InternodeBackend" and isinstance(tr, NvshmemTransport), type(tr)
    assert backend.kernels is not None and backend.kernels.transport_name == "nvshmem"
    chunks = backend.kernels.device_puts.NVSHMEM_CHUNKS
    assert tr.signals_per_round == chunks and tr.peers == peers
    assert tr._device_rounds is backend.kernels.device_puts  # count rounds from the GPU too: no host sync of theirs
    check_cases(rank, world, gpn, nv, ref, lambda: {p: {"rounds": tr.round} for p in peers}, _rounds, "rounds")
    check_bad_ids(rank, world, nv, ref)  # before the counters are read: no peer is a round ahead then

    # Every round added exactly `chunks` to each rail peer's signal word (host rounds SET that value), every
    # credit is the round, and no other rank's word moved.
    signal, credit = tr.counters("signal"), tr.counters("credit")
    for p in range(world):
        assert p == rank or (signal[p] == (tr.round * chunks if p in peers else 0)
                             and credit[p] == (tr.round if p in peers else 0)), \
            f"rank {rank}: after {tr.round} rounds, signal {signal}, credit {credit} (peer {p})"
    assert backend.nic_totals() == {}
    nv.destroy()
    ref.destroy()
    ns.finalize()


def _missing_peer_worker(rank, world):
    import torch.distributed as dist

    import deepcomm
    from deepcomm.cuda import nvshmem_session as ns
    from deepcomm.errors import CommTimeoutError

    dev = rank_device(rank)
    idx = torch.zeros(4, 2, dtype=torch.int64, device=dev)
    idx[:, 1] = E - 1  # every token to both ranks
    x = torch.ones(4, 256, dtype=torch.bfloat16, device=dev)
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=256, backend="cuda", gpus_per_node=1, timeout_s=2,
                          internode_transport="nvshmem")
    recv = buf.dispatch(x, topk_idx=idx, num_experts=E)  # both ranks: a count round and a kernel round
    if rank == 0:  # rank 1 never combines: our kernel's bounded waits give up on it
        with pytest.raises(CommTimeoutError) as info:  # a combine does not wait: synchronize() reports it
            buf.combine(recv[0], recv[4])
            buf.synchronize()
        e = info.value
        assert (e.rank, e.peer) == (0, 1) and e.stage.startswith("nvshmem:"), str(e)
        with pytest.raises(RuntimeError):
            buf.dispatch(x, topk_idx=idx, num_experts=E)  # refused until rebuilt
    dist.barrier()
    buf.destroy()
    ns.finalize()


def _missing_count_peer_worker(rank, world):
    """Rank 1 never makes the fresh dispatch: rank 0's count round, issued from the GPU, gives up on its credit
    (nothing is put into rank 1's slot) and the call raises naming rank 1 and an NVSHMEM stage."""
    import torch.distributed as dist

    import deepcomm
    from deepcomm.cuda import nvshmem_session as ns
    from deepcomm.errors import CommTimeoutError

    dev = rank_device(rank)
    idx = torch.zeros(4, 2, dtype=torch.int64, device=dev)
    idx[:, 1] = E - 1
    x = torch.ones(4, 256, dtype=torch.bfloat16, device=dev)
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=256, backend="cuda", gpus_per_node=1, timeout_s=2,
                          internode_transport="nvshmem")
    tr = buf._backend.transport
    if rank == 0:
        with pytest.raises(CommTimeoutError) as info:
            buf.dispatch(x, topk_idx=idx, num_experts=E)
        e = info.value
        assert (e.rank, e.peer) == (0, 1) and e.stage.startswith("nvshmem:credit"), str(e)
        assert tr.counters("signal")[1] == 0  # rank 1 sent nothing
    dist.barrier()
    if rank == 1:
        assert tr.counters("signal")[0] == 0, "rank 0 put its counts into a slot never freed for it"
    buf.destroy()
    ns.finalize()


def test_internode_nvshmem_device_2x1_against_reference():
    run_on_gpus(_device_worker, 2, 1, timeout_s=400)


@pytest.mark.parametrize("nodes, gpn", [pytest.param(2, 2, marks=needs_ranks(4, "2 nodes x 2 GPUs"))])
def test_internode_nvshmem_device_2x2_against_reference(nodes, gpn):
    run_on_gpus(_device_worker, nodes * gpn, gpn, timeout_s=400)


def test_internode_nvshmem_device_missing_peer_times_out():
    run_on_gpus(_missing_peer_worker, 2, timeout_s=240)


def test_internode_nvshmem_device_count_round_missing_peer_times_out():
    run_on_gpus(_missing_count_peer_worker, 2, timeout_s=240)
