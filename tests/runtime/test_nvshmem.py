"""NVSHMEM from the pip wheel on 2 GPUs: unique-id bootstrap over torch.distributed, symmetric blocks read and
written through nvshmem_ptr, the collective deferred free, finalize; the low-latency kernels with their buffer on
the symmetric heap (DEEPCOMM_LL_MEMORY=nvshmem) against the reference; and the mpirun bootstrap through mpi4py."""
import importlib.util
import os
import shutil
import signal
import subprocess

import pytest
import torch

from tests.helpers.nccl_run import has_nvshmem_wheel, needs_ranks, rank_device, ranks_for_tests, run_on_gpus
from tests.low_latency.test_ll_kernels import check_cases, ll_buffer
from tests.helpers.paths import ROOT


pytestmark = [pytest.mark.gpu, needs_ranks(2),
              pytest.mark.skipif(not has_nvshmem_wheel(),
                                 reason="nvidia.nvshmem is not importable (pip install nvidia-nvshmem-cu13)")]


def _pattern(seed, nbytes, dev):
    return ((torch.arange(nbytes, device=dev, dtype=torch.int64) * (2 * seed + 3) + seed) % 251).to(torch.uint8)


def _symmetric_worker(rank, world):
    import torch.distributed as dist

    from deepcomm._ext import load_extension
    from deepcomm.cuda import nvshmem_session as ns
    from deepcomm.cuda.arena import as_device_bytes
    dev = rank_device(rank)
    group = dist.group.WORLD
    n = ns.load_library()
    assert n.library_version()[0] == 3, n.library_version()
    assert n.init_status() == 0 and not ns.is_initialized()
    session = ns.init_with_torch(group, heap_bytes=64 << 20)
    assert session.how == "torch.distributed" and session.ranks == tuple(range(world))
    assert (n.my_pe(), n.n_pes()) == (rank, world) and n.init_status() >= 1  # bootstrapped at least

    # each rank writes a pattern into its block; after a barrier everyone reads every block through nvshmem_ptr.
    # Peer mappings are copied with cudaMemcpy (C.copy_bytes): a torch view of one would be placed on the owner's
    # device by torch's pointer lookup, and copied.
    C = load_extension()
    stream = torch.cuda.current_stream(dev).cuda_stream
    nbytes = (1 << 20) + 4096
    block, ptr = ns.allocate(group, nbytes)
    assert n.init_status() >= 2  # NVSHMEM_STATUS_IS_INITIALIZED
    peers = ns.peer_ptrs(ptr, world)
    assert peers[rank] == ptr and len(set(peers)) == world, peers
    mine = as_device_bytes(ptr, nbytes, dev)
    assert mine.data_ptr() == ptr  # a view of our own block, not a copy
    mine.copy_(_pattern(rank, nbytes, dev))
    torch.cuda.synchronize(dev)
    ns.barrier()
    for r in range(world):
        seen = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        C.copy_bytes(seen.data_ptr(), peers[r], nbytes, stream)
        torch.cuda.synchronize(dev)
        assert torch.equal(seen, _pattern(r, nbytes, dev)), f"rank {rank} read rank {r}'s block wrong"
    ns.barrier()
    # and writes into the next rank's block through its mapping
    src = _pattern(10 + rank, nbytes, dev)
    C.copy_bytes(peers[(rank + 1) % world], src.data_ptr(), nbytes, stream)
    torch.cuda.synchronize(dev)
    ns.barrier()
    assert torch.equal(mine, _pattern(10 + (rank - 1) % world, nbytes, dev)), "a peer's write did not land"

    # release is local; a block is freed at the next allocation only once every rank released it
    ns.release(block)
    second, _ = ns.allocate(group, nbytes)
    assert block not in session.blocks and second in session.blocks
    if rank == 0:
        ns.release(second)
    third, _ = ns.allocate(group, nbytes)
    assert second in session.blocks, "freed while rank 1 still held it"
    if rank != 0:
        ns.release(second)
    ns.release(third)
    fourth, _ = ns.allocate(group, nbytes)
    assert second not in session.blocks and third not in session.blocks and fourth in session.blocks

    ns.finalize()
    assert not ns.is_initialized() and not n.initialized()
    with pytest.raises(RuntimeError, match="finalized"):
        ns.init_with_torch(group)


def test_symmetric_heap_bootstrapped_by_unique_id():
    run_on_gpus(_symmetric_worker, ranks_for_tests(), timeout_s=180)


def _low_latency_worker(rank, world):
    os.environ["DEEPCOMM_LL_MEMORY"] = "nvshmem"
    from deepcomm.cuda import nvshmem_session as ns
    from deepcomm.cuda.nvshmem_memory import NvshmemMemory
    dev = rank_device(rank)
    gen = torch.Generator().manual_seed(700 + rank)
    cuda, ref = ll_buffer("cuda", num_sms=16), ll_buffer("reference")
    assert cuda.low_latency_buffer_info() == {"memory": "nvshmem", "bytes": 0}
    assert ref.low_latency_buffer_info() == {"memory": None, "bytes": 0}
    # largest shape first: it sizes the symmetric heap; the later shapes remake the buffer inside it
    cases = [(128, 7168, 64, 8, "random", "fp8"), (7, 2048, 64, 4, "masked", "bf16"),
             (0 if rank == 0 else 5, 5120, 32, 6, "masked", "ue8m0")]
    check_cases(cuda, ref, cases, gen, dev, world)

    ll = cuda._backend.ll.buffer
    assert isinstance(ll.memory, NvshmemMemory)
    assert cuda.low_latency_buffer_info() == {"memory": "nvshmem", "bytes": ll.layout["total"]}
    n = ns.load_library()
    assert ll.memory.peer_ptrs == [n.peer_ptr(ll.memory.ptr, r) for r in range(world)]
    assert ns.current().how == "torch.distributed" and len(ns.current().blocks) >= 1
    cuda.destroy()
    ref.destroy()
    ns.finalize()


def test_low_latency_on_nvshmem_matches_reference():
    run_on_gpus(_low_latency_worker, ranks_for_tests(), timeout_s=300)


@pytest.mark.skipif(shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
                    reason="needs mpirun and mpi4py")
def test_mpirun_bootstraps_nvshmem_through_mpi():
    env = dict(os.environ, NP="2", DEEPCOMM_LL_MEMORY="nvshmem", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    script = os.path.join(ROOT, "tests", "runtime", "nvshmem_mpi_check.py")
    # its own session, so a hang past the deadline takes mpirun and both ranks down with it
    p = subprocess.Popen(["bash", os.path.join(ROOT, "launch", "mpirun.sh"), script], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"mpirun did not finish within 240 s:\n{out}")
    assert p.returncode == 0, out
    assert out.count("NVSHMEM over MPI: OK") == 2, out
