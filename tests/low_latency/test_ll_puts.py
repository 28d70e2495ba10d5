"""Low-latency mode with every peer reached by NVSHMEM puts (DEEPCOMM_LL_FORCE_PUTS=1 on NVSHMEM memory), on 2 GPUs
that NVLink could map: the send halves write into our own outbox blocks, the host puts their data and then their
flags (the per-block arrival words) into the peer's inbox, and the results match the reference bit for bit, with and
without a hook, and in a replayed CUDA graph. This is the path of peers on other nodes (deepcomm/cuda/ll_buffer.py),
proven here between NVLink peers."""
import os

import pytest
import torch

from tests.helpers.nccl_run import has_nvshmem_wheel, needs_ranks, rank_device, ranks_for_tests, run_on_gpus
from tests.low_latency.test_ll_kernels import M, _check_dispatch, _routing, check_cases, check_graph_replay, ll_buffer

pytestmark = [pytest.mark.gpu, needs_ranks(2),
              pytest.mark.skipif(not has_nvshmem_wheel(),
                                 reason="nvidia.nvshmem is not importable (pip install nvidia-nvshmem-cu13)")]


def _forced_puts_worker(rank, world):
    os.environ["DEEPCOMM_LL_MEMORY"] = "nvshmem"
    os.environ["DEEPCOMM_LL_FORCE_PUTS"] = "1"
    dev = rank_device(rank)
    gen = torch.Generator().manual_seed(900 + rank)
    cuda, ref = ll_buffer("cuda", num_sms=16), ll_buffer("reference")
    # largest shape first: it sizes the symmetric heap
    cases = [(128, 7168, 64, 8, "random", "fp8"), (7, 2048, 64, 4, "masked", "bf16"),
             (0 if rank == 0 else 5, 2176, 32, 6, "random", "ue8m0"), (33, 2176, 32, 6, "one_expert", "bf16")]
    check_cases(cuda, ref, cases, gen, dev, world)
    ll = cuda._backend.ll.buffer
    assert ll.put_peers == [p for p in range(world) if p != rank], ll.put_peers  # forced: every peer
    assert cuda.low_latency_buffer_info()["memory"] == "nvshmem"

    # hook mode, both slots in flight before either is received
    T, H, E, K = 64, 2176, 32, 6
    pending = []
    for _ in range(2):
        idx, w = _routing(gen, T, E, K, "random", dev)
        x = (torch.randn(T, H, generator=gen) * 2).to(torch.bfloat16).to(dev)
        got = cuda.low_latency_dispatch(x, idx, M, E, use_fp8=True, return_recv_hook=True)
        pending.append((x, idx, w, got))
    for x, idx, w, got in pending:
        got[3]()
        want = ref.low_latency_dispatch(x, idx, M, E, use_fp8=True)
        _check_dispatch(got, want, "hook")
        y = torch.randn(E // world, world * M, H, generator=gen).to(torch.bfloat16).to(dev)
        out, hook = cuda.low_latency_combine(y, idx, w, got[2], return_recv_hook=True)
        hook()
        assert torch.equal(out, ref.low_latency_combine(y, idx, w, want[2])[0]), "hook combine"
    torch.cuda.synchronize(dev)

    # CUDA graph: dispatch + combine (with their on-stream puts and the combine's weights phase) captured once,
    # replayed with new inputs.
    check_graph_replay(cuda, ref, gen, dev, world, T, E, K, H, "graph replay with puts")
    from deepcomm.cuda import nvshmem_session as ns
    cuda.destroy()
    ref.destroy()
    ns.finalize()


def test_low_latency_through_forced_puts_matches_reference():
    run_on_gpus(_forced_puts_worker, ranks_for_tests(), timeout_s=300)
