"""Call agreement on the internode backend (deepcomm/internode/hier_agree.py) at 2 nodes x 1 GPU (two GPUs, or both
ranks on GPU 0 in shared mode), over each transport of its RDMA hop: the emulated NIC, NVSHMEM device puts and
NVSHMEM's host API (the NVSHMEM ones where the wheel and, for device puts, deepcomm._nvshmem_kernels are there).
Every disagreement of tests/agreement/test_agreement_gpu.py (fresh and cached dispatch, combine, low-latency
calls, a rank that rejected its input, another kind of call) raises on every rank the text the reference
backend raises; the next agreeing round is bit-exact against it. Also on both CUDA backends: a rejected
low-latency combine of an older handle (not the latest dispatch's) raises on every rank instead of timing out."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.agreement.test_agreement_gpu import (E, H, M, T, Inputs, Side, _agreeing_round, _cases,
                                                _expect_disagreement, _first_low_latency_cases, _outcome)
from tests.helpers.nccl_run import cuda_buffer, has_nvshmem_wheel, needs_ranks, rank_device, reference, run_on_gpus, scaled

pytestmark = [pytest.mark.gpu, needs_ranks(2)]


def _transport_params():
    device_built = importlib.util.find_spec("deepcomm._nvshmem_kernels") is not None
    no_wheel = pytest.mark.skipif(not has_nvshmem_wheel(), reason="nvidia.nvshmem is not importable")
    return [pytest.param("emulated", id="emulated"),
            pytest.param("nvshmem", id="nvshmem", marks=[no_wheel, pytest.mark.skipif(
                not device_built, reason="deepcomm._nvshmem_kernels is not built")]),
            pytest.param("nvshmem-host", id="nvshmem-host", marks=[no_wheel])]


def _buffers(dev, **extra):
    kw = dict(max_tokens_per_rank=4 * T, hidden=H, num_max_low_latency_tokens=M, timeout_s=20)
    ref_kw = {k: v for k, v in extra.items() if k == "gpus_per_node"}
    return [Side("cuda", cuda_buffer(num_sms=8, **kw, **extra)), Side("reference", reference(dev, **kw, **ref_kw))]


def _older_handle_case(rank, me, dev):
    """Two low-latency dispatches, then a combine of the first one's handle that rank ``me`` rejected."""
    odd = rank == me
    inp = Inputs(torch.Generator().manual_seed(9 + rank), dev)

    def call(s):
        older = s.buf.low_latency_dispatch(inp.x, inp.idx, M, E, use_fp8=False)
        s.buf.low_latency_dispatch(inp.x, inp.idx, M, E, use_fp8=False)  # the latest dispatch: the other slot
        w = inp.w.double() if odd else inp.w
        return s.buf.low_latency_combine(older[0], inp.idx, w, older[2])
    return ("low-latency combine of an older handle, a rank rejected its topk_weights", call, True)


def _internode_worker(rank, world, transport):
    dev = rank_device(rank)
    torch.cuda.set_device(dev)
    sides = _buffers(dev, gpus_per_node=1, internode_transport=transport)
    backend = sides[0].buf._backend
    assert type(backend).__name__ == "InternodeBackend" and backend.capabilities.takes_fingerprints
    me = world - 1
    for what, call, deferred in _first_low_latency_cases(rank, me, dev):
        _expect_disagreement(sides, call, rank, what, deferred)
    gen = torch.Generator().manual_seed(1000 + rank)
    _agreeing_round(sides, Inputs(gen, dev), rank, "the first low-latency cases")
    for what, call, deferred in _cases(rank, world, me, dev) + [_older_handle_case(rank, me, dev)]:
        _expect_disagreement(sides, call, rank, f"{transport}: {what}", deferred)
        _agreeing_round(sides, Inputs(gen, dev), rank, what)
    for s in sides:
        s.buf.destroy()


def _older_handle_worker(rank, world, gpus_per_node):
    dev = rank_device(rank)
    torch.cuda.set_device(dev)
    extra = {} if gpus_per_node is None else {"gpus_per_node": gpus_per_node}
    sides = _buffers(dev, **extra)
    gen = torch.Generator().manual_seed(3000 + rank)
    _agreeing_round(sides, Inputs(gen, dev), rank, "the start")
    what, call, deferred = _older_handle_case(rank, world - 1, dev)
    for _ in range(2):  # twice: the second rejection meets the other slot
        _expect_disagreement(sides, call, rank, what, deferred)
        _agreeing_round(sides, Inputs(gen, dev), rank, what)
    for s in sides:
        s.buf.destroy()


@pytest.mark.parametrize("transport", _transport_params())
def test_internode_disagreements_raise_on_every_rank_with_the_reference_text(transport):
    run_on_gpus(_internode_worker, 2, transport, timeout_s=scaled(600))


@pytest.mark.parametrize("gpus_per_node", [None, 1], ids=["single-node", "internode"])
def test_rejected_combine_of_an_older_handle_raises_everywhere(gpus_per_node):
    run_on_gpus(_older_handle_worker, 2, gpus_per_node, timeout_s=scaled(300))


def _two_gpus_per_node_worker(rank, world, kernels):
    """2 nodes x 2 GPUs, on the kernels (their NVLink hop carries every rank's words into the strip) and on the
    torch routing (DEEPCOMM_INTERNODE_KERNELS=0): every normal-mode disagreement of one kind of call (fresh
    dispatch, cached dispatch, combine, a rank that rejected its input) raises on every rank the reference text,
    and the next agreeing round is bit-exact. On the torch routing also a fresh dispatch on one rank against a
    combine on the others (each rank raises the call order of the words it heard)."""
    import os
    os.environ["DEEPCOMM_INTERNODE_KERNELS"] = "1" if kernels else "0"
    dev = rank_device(rank)
    torch.cuda.set_device(dev)
    sides = _buffers(dev, gpus_per_node=2, internode_transport="emulated")
    backend = sides[0].buf._backend
    assert type(backend).__name__ == "InternodeBackend" and backend.capabilities.takes_fingerprints
    assert (backend.kernels is not None) is kernels
    gen = torch.Generator().manual_seed(2000 + rank)
    _agreeing_round(sides, Inputs(gen, dev), rank, "the start")
    for me in (1, world - 1):  # a node peer of rank 0, then a rank on neither its node nor its rail
        for what, call, deferred in _cases(rank, world, me, dev):
            if "low-latency" in what or " on the others" in what:  # one kind of call at a time (troubleshooting.md)
                continue
            _expect_disagreement(sides, call, rank, f"2x2, odd rank {me}: {what}", deferred)
            _agreeing_round(sides, Inputs(gen, dev), rank, what)
    # On the torch routing calls of different kinds meet too (hier_agree.py): one odd rank is never a checkerboard.
    # A rank that did not hear every rank's words names those it heard, and the ranks it did not.
    for me in (1, world - 1) if not kernels else ():
        for what, call, _ in _cases(rank, world, me, dev):
            if " on the others" not in what or "low-latency" in what:
                continue
            ref, got = _outcome(sides[1], call), _outcome(sides[0], call)
            assert ref is not None and ref.startswith("call order: the ranks are in different calls"), ref
            assert got is not None and got.startswith("call order: the ranks are in different calls"), (
                f"2x2, odd rank {me}: {what}, rank {rank}: {got!r}")
            assert got == ref or "did not reach this rank" in got, f"rank {rank}: {got!r} against {ref!r}"
            _agreeing_round(sides, Inputs(gen, dev), rank, what)
    for s in sides:
        s.buf.destroy()


@needs_ranks(4)
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch-routing"])
def test_internode_disagreements_at_two_gpus_per_node(kernels):
    run_on_gpus(_two_gpus_per_node_worker, 4, kernels, timeout_s=scaled(900))
