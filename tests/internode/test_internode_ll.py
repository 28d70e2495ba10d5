"""Low-latency mode on the internode backend (2 GPUs posing as 2 nodes x 1 GPU): the low-latency kernels over both
ranks (deepcomm/internode/internode_ll.py), bit for bit against the reference: the peer through CUDA IPC (one host),
then through NVSHMEM puts (DEEPCOMM_LL_FORCE_PUTS=1, the path of a peer on another node); a replayed CUDA graph;
normal mode on the same Buffer afterwards; a peer that never joins gives CommTimeoutError naming the stage; with
DEEPCOMM_TEST_WORLD of 34 or more (shared GPU), low-latency mode past 32 ranks."""
import os

import pytest
import torch

from tests.helpers.nccl_run import has_nvshmem_wheel, needs_ranks, rank_device, ranks_for_tests, run_on_gpus
from tests.low_latency.test_ll_kernels import M, _routing, check_cases, check_graph_replay, ll_buffer

pytestmark = [pytest.mark.gpu, needs_ranks(2)]


def _internode_ll_worker(rank, world, memory):
    if memory == "nvshmem":
        os.environ["DEEPCOMM_LL_MEMORY"] = "nvshmem"
        os.environ["DEEPCOMM_LL_FORCE_PUTS"] = "1"
    dev = rank_device(rank)
    gen = torch.Generator().manual_seed(1200 + rank)
    cuda, ref = ll_buffer("cuda", num_sms=16, gpus_per_node=1), ll_buffer("reference", gpus_per_node=1)
    assert type(cuda._backend).__name__ == "InternodeBackend"
    # largest shape first: it sizes the symmetric heap
    cases = [(128, 7168, 64, 8, "random", "fp8"), (0 if rank == 0 else 5, 2176, 32, 6, "masked", "bf16"),
             (33, 2176, 32, 6, "one_expert", "ue8m0")]
    check_cases(cuda, ref, cases, gen, dev, world)
    ll = cuda._backend.ll.engine.buffer
    others = [p for p in range(world) if p != rank]  # every rank is a node of its own: all are put peers
    assert ll.put_peers == (others if memory == "nvshmem" else []), ll.put_peers
    assert cuda.low_latency_buffer_info()["memory"] == memory
    check_graph_replay(cuda, ref, gen, dev, world, 64, 32, 6, 2176, f"internode graph replay ({memory})")

    # normal mode on the same Buffer (the hierarchical path) is unaffected
    T, H, E, K = 48, 2176, 32, 6
    idx, w = _routing(gen, T, E, K, "random", dev)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
    got = cuda.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    want = ref.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), "normal dispatch after low-latency calls"
    cuda.synchronize()
    cuda.destroy()
    ref.destroy()
    if memory == "nvshmem":
        from deepcomm.cuda import nvshmem_session as ns
        ns.finalize()


@pytest.mark.parametrize("memory", ["ipc", "nvshmem"])
def test_internode_low_latency_matches_reference(memory):
    if memory == "nvshmem" and not has_nvshmem_wheel():
        pytest.skip("nvidia.nvshmem is not importable (pip install nvidia-nvshmem-cu13)")
    run_on_gpus(_internode_ll_worker, ranks_for_tests(), memory, timeout_s=240)


def _past_32_worker(rank, world):
    """More ranks than one 32-bit word holds: ranks 32 and up are live, send and receive rows (G = 2: at most 32
    nodes)."""
    dev = rank_device(rank)
    gen = torch.Generator().manual_seed(3300 + rank)
    cuda, ref = ll_buffer("cuda", gpus_per_node=2), ll_buffer("reference", gpus_per_node=2)
    E = 2 * world
    cases = [(24, 2176, E, 6, "random", "fp8"), (0 if rank == world - 1 else 7, 2176, E, 6, "masked", "bf16"),
             (9, 2176, world, 4, "random", "ue8m0")]
    check_cases(cuda, ref, cases, gen, dev, world)
    cuda.synchronize()
    cuda.destroy()
    ref.destroy()


@needs_ranks(34, "low-latency mode past 32 ranks")
def test_internode_low_latency_past_32_ranks_matches_reference():
    world = ranks_for_tests()
    if world % 2:
        pytest.skip("an even number of ranks (2 GPUs per node, at most 32 nodes)")
    run_on_gpus(_past_32_worker, world, timeout_s=400)


def _missing_peer_worker(rank, world):
    import torch.distributed as dist

    import deepcomm
    from deepcomm.errors import CommTimeoutError

    dev = rank_device(rank)
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=256, backend="cuda", gpus_per_node=1, timeout_s=2,
                          num_max_low_latency_tokens=16)
    idx = torch.zeros(4, 2, dtype=torch.int64, device=dev)
    idx[:, 1] = 3
    x = torch.ones(4, 256, dtype=torch.bfloat16, device=dev)
    buf.low_latency_dispatch(x, idx, 16, 4, use_fp8=False)  # both ranks: the buffer is made collectively
    torch.cuda.synchronize(dev)
    dist.barrier()
    if rank == 0:  # rank 1 does not send this time: our receive gives up after 2 s
        # its first wait is for the peer's words (the call's agreement), then for its data: either names peer 1
        stage = r"rank 0 timed out waiting for peer 1 at stage '(agree|low_latency_dispatch:data)"
        with pytest.raises(CommTimeoutError, match=stage):
            buf.low_latency_dispatch(x, idx, 16, 4, use_fp8=False)
            buf.synchronize()
        with pytest.raises(RuntimeError, match="destroy it"):
            buf.dispatch(x, topk_idx=idx, num_experts=4)
    dist.barrier()
    buf.destroy()


def test_internode_low_latency_missing_peer_times_out():
    run_on_gpus(_missing_peer_worker, 2, timeout_s=120)
