"""Buffers give back what they take: Buffer.size_bytes() matches deepcomm.sizing and the device memory a Buffer
takes, and 1,000 create/destroy cycles on 2 GPUs (a normal round in some, a low-latency round in others, three ways
of letting go) leave device memory where it started."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.nccl_run import needs_ranks, rank_device, run_on_gpus, shared_gpu

pytestmark = [pytest.mark.gpu, needs_ranks(2)]

CYCLES = 1000
MiB = 1 << 20
# Allowed drift of free device memory over all cycles. The driver may keep a few MiB of pooled pages for small
# cudaMalloc / IPC mappings after a free; one leaked buffer per cycle would be CYCLES * size_bytes (GiB here).
SLACK = 16 * MiB
# Allowed drift of torch.cuda.memory_allocated: torch.distributed's watchdog may still hold the small tensors of the
# last collectives (all_gather_object, barrier) for a moment; one leaked round's tensors per cycle would be >25 MiB.
ALLOC_SLACK = 1 * MiB
# Allowed difference between size_bytes() and the free memory a large Buffer takes: page rounding of the one
# allocation plus small torch/NCCL scratch of the construction's collectives.
SIZE_TOLERANCE = 8 * MiB
SMALL = dict(max_tokens_per_rank=64, hidden=1024, num_max_low_latency_tokens=32, num_sms=4, timeout_s=30)
T, E, K, M = 64, 16, 2, 32


def _free(dev) -> int:
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(dev)[0]


def _round(buf, low_latency: bool, gen) -> None:
    dev = buf.device
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.to(dev)
    x = torch.randn(T, 1024, generator=gen).to(torch.bfloat16).to(dev)
    if low_latency:  # at most M tokens per rank in low-latency mode
        x, idx = x[:M], idx[:M]
        w = torch.rand(M, K, generator=gen).to(dev)
        recv_x, _, handle, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        out, _ = buf.low_latency_combine(recv_x, idx, w, handle)
    else:
        recv_x, _, _, _, handle = buf.dispatch(x, topk_idx=idx, num_experts=E)
        out, _ = buf.combine(recv_x, handle)
    assert out.shape == x.shape and bool(torch.isfinite(out.float()).all())


def _cycle(i: int, gen) -> None:
    import deepcomm
    buf = deepcomm.Buffer(backend="cuda", **SMALL)
    if i % 10 == 3:
        _round(buf, False, gen)
    if i % 10 == 7:
        _round(buf, True, gen)
    # three ways to let go: destroy(), the context manager, dropping the last reference
    if i % 3 == 0:
        buf.destroy()
    elif i % 3 == 1:
        with buf:
            pass
    else:
        del buf


def _sizes_worker(rank, world):
    import deepcomm
    from deepcomm.sizing import ll_buffer_bytes, nvl_buffer_bytes
    import torch.distributed as dist
    dev = rank_device(rank)
    gen = torch.Generator().manual_seed(7 + rank)
    _cycle(7, gen)  # warm-up: NCCL, peer access, torch allocator pools
    nvl = nvl_buffer_bytes(world, SMALL["max_tokens_per_rank"], SMALL["hidden"])["total"]
    with deepcomm.Buffer(backend="cuda", **SMALL) as buf:
        assert buf.size_bytes() == nvl, (buf.size_bytes(), nvl)
        _round(buf, True, gen)
        assert buf.size_bytes() == nvl + ll_buffer_bytes(world, E, M, SMALL["hidden"])
    # A large Buffer: the free memory it takes is its size_bytes() (up to page rounding and scratch).
    big = dict(max_tokens_per_rank=1024, hidden=7168)
    # Where every rank shares GPU 0, the GPU's free memory drops by every rank's Buffer: measure between barriers
    # and expect one Buffer per rank on the device.
    per_device = world if shared_gpu() else 1
    tolerance = SIZE_TOLERANCE * per_device
    dist.barrier()
    before = _free(dev)
    dist.barrier()
    buf = deepcomm.Buffer(backend="cuda", **big)
    dist.barrier()
    taken = before - _free(dev)
    dist.barrier()
    size = buf.size_bytes()
    assert size == nvl_buffer_bytes(world, big["max_tokens_per_rank"], big["hidden"])["total"]
    assert abs(taken - per_device * size) <= tolerance, (
        f"size_bytes() {size} ({per_device} Buffer(s) on this GPU) but the Buffers took {taken} bytes")
    buf.destroy()
    dist.barrier()
    assert before - _free(dev) <= tolerance, "destroy() did not give the large Buffer's memory back"


def test_size_bytes_is_what_a_buffer_takes():
    run_on_gpus(_sizes_worker, 2, timeout_s=180)


def _cycles_worker(rank, world):
    import torch.distributed as dist
    dev = rank_device(rank)
    gen = torch.Generator().manual_seed(17 + rank)
    for i in range(10):  # warm-up: NCCL buffers, peer access, allocator pools, both kinds of round
        _cycle(i, gen)
    dist.barrier()  # the peer has closed its mappings of our buffers too
    free0, alloc0 = _free(dev), torch.cuda.memory_allocated(dev)
    for i in range(CYCLES):
        _cycle(i, gen)
    dist.barrier()
    free1, alloc1 = _free(dev), torch.cuda.memory_allocated(dev)
    assert alloc1 - alloc0 <= ALLOC_SLACK, f"rank {rank}: torch.cuda.memory_allocated went from {alloc0} to {alloc1}"
    assert free0 - free1 <= SLACK, (f"rank {rank}: {(free0 - free1) / MiB:.1f} MiB of device memory not given back "
                                    f"after {CYCLES} Buffer cycles (slack {SLACK // MiB} MiB)")


def test_create_destroy_cycles_do_not_leak():
    run_on_gpus(_cycles_worker, 2, timeout_s=300)
