"""Normal mode at world size 1 (one GPU, one rank): the fresh, cached, worst-case-size and bounce paths of the
NVLink kernels against the reference backend, bit for bit. Every row is local, so this runs wherever one GPU is."""
import pytest
import torch

from tests.helpers.nccl_run import cuda_buffer, gpu_count, rank_device, reference, run_on_gpus
from tests.normal.test_graph_async import _worker as graph_async_worker
from tests.normal.test_intranode import _intranode_worker, _kept_inputs, _many_chunks_worker, _same

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")]


def test_intranode_cases_at_world_size_1():
    run_on_gpus(_intranode_worker, 1)


def test_worst_case_graph_and_async_at_world_size_1():
    run_on_gpus(graph_async_worker, 1)


def test_many_notify_chunks_at_world_size_1():
    run_on_gpus(_many_chunks_worker, 1)


def _late_bounce_worker(rank, world):
    """Dispatches from torch's default stream with the arena full go through the bounce area; one queued behind a
    long kernel on that stream must copy its rows out after they land, not at once (its copies once ran on a pool
    stream that waited for nothing)."""
    dev = rank_device(rank)
    torch.cuda.set_device(dev)
    assert torch.cuda.current_stream(dev).cuda_stream == 0, "the test needs the default stream"
    cuda = cuda_buffer(max_tokens_per_rank=1024, hidden=7168, num_sms=24, timeout_s=20)
    ref = reference(dev, max_tokens_per_rank=1024, hidden=7168)
    kept, i = [], 0
    while cuda._backend.bounced_calls == 0:  # keep every output until a dispatch finds no block left
        assert i < 16, "the arena never filled"
        idx, w, x = _kept_inputs(rank, i, dev)
        kept.append(cuda.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=256))
        i += 1
    handle = kept[-1][4]
    for j in range(3):  # a cached dispatch of the last handle (its rows fit no block either), new values each time
        x = torch.randn(1024, 7168, generator=torch.Generator().manual_seed(900 + j)).to(torch.bfloat16).to(dev)
        want = ref.dispatch(x, topk_idx=_kept_inputs(rank, i - 1, dev)[0], num_experts=256)[0]
        torch.cuda._sleep(200_000_000)  # the payload waits behind this on the default stream
        got = cuda.dispatch(x, handle=handle)[0]
        assert cuda._backend.last_placement == "bounce", cuda._backend.last_placement
        _same(got, want, f"cached dispatch {j} through the bounce area, behind a long kernel")
    cuda.synchronize()
    cuda.destroy()
    ref.destroy()


def test_a_late_bounced_dispatch_copies_its_rows_after_they_land():
    run_on_gpus(_late_bounce_worker, 1)
