"""Low-latency shape changes on the CUDA backend's kernels, at DEEPCOMM_TEST_WORLD ranks (one GPU each, or all on
GPU 0 in shared mode): once the low-latency buffer exists, a rank that changes hidden, num_experts or
num_max_dispatch_tokens_per_rank of a low-latency dispatch while the others keep theirs raises ValueError in the
call, and the others by their next look (here synchronize()), with the very text the reference backend raises; the
Buffer's next agreeing round is bit-exact against the reference backend. A change made by every rank at once
remakes the buffer and runs as on a fresh Buffer. The shape changes run once more with every peer reached by
NVSHMEM puts (DEEPCOMM_LL_FORCE_PUTS=1), whose words travel inside the puts. A normal-mode call on some ranks met by
a low-latency call on the others raises the reference text on every rank too, and the Buffer goes on with agreeing
calls of both modes; also when the low-latency call is a Buffer's first (the one that makes the low-latency
buffer), or a first one a rank rejected, and when it is a later one of a new shape (which remakes the buffer) or
one a rank rejected. Through puts, where no exchange compares a normal-mode call with a low-latency one, each
rank's timeout names the stage at which the others gave up, and a rebuilt Buffer works."""
from __future__ import annotations

import pytest
import torch

from tests.agreement.test_agreement_gpu import (E, H, M, T, Inputs, Side, _agreeing_round, _buffers,
                                                _expect_disagreement, _round, _same, worker_device)
from tests.helpers.nccl_run import (cuda_buffer, has_nvshmem_wheel, needs_ranks, ranks_for_tests, run_on_gpus,
                                    scaled)

pytestmark = [pytest.mark.gpu, needs_ranks(2)]

WORLD = ranks_for_tests()


def _shape_cases(rank, me, dev):
    odd = rank == me
    gen = torch.Generator().manual_seed(31 + rank)
    inp = Inputs(gen, dev)
    narrow = Inputs(gen, dev, hidden=H // 2 if odd else H)
    return [
        ("low-latency dispatch after the first, hidden differs",
         lambda s: s.buf.low_latency_dispatch(narrow.x, narrow.idx, M, E, use_fp8=False)),
        ("low-latency dispatch after the first, num_experts differs",
         lambda s: s.buf.low_latency_dispatch(inp.x, inp.idx, M, 2 * E if odd else E, use_fp8=False)),
        ("low-latency dispatch after the first, num_max_dispatch_tokens_per_rank differs",
         lambda s: s.buf.low_latency_dispatch(inp.x, inp.idx, M - 4 if odd else M, E, use_fp8=False)),
    ]


def _shape_worker(rank, world, puts=False):
    """``puts``: with every peer reached by NVSHMEM puts (the new shape's words travel inside the puts)."""
    dev = worker_device(rank, puts)
    sides = _buffers(dev)
    me = world - 1
    tag = " (puts)" if puts else ""
    gen = torch.Generator().manual_seed(3000 + rank)
    _agreeing_round(sides, Inputs(gen, dev), rank, "the start" + tag)
    if puts:
        assert sides[0].buf._backend.ll.buffer.put_peers == [p for p in range(world) if p != rank]
    for what, call in _shape_cases(rank, me, dev):
        _expect_disagreement(sides, call, rank, what + tag)
        _agreeing_round(sides, Inputs(gen, dev), rank, what + tag)
    # every rank changes hidden at the same call: the buffer is remade everywhere, the results stay exact
    narrow = Inputs(gen, dev, hidden=H // 2)
    got = {}
    for s in sides:
        recv_x, count, handle, _ = s.buf.low_latency_dispatch(narrow.x, narrow.idx, M, E, use_fp8=False)
        out, _ = s.buf.low_latency_combine(recv_x, narrow.idx, narrow.w, handle)
        got[s.label] = (count.clone(), out.clone())
    for a, b, name in zip(got["cuda"], got["reference"], ("recv_count", "combine")):
        _same(a, b, f"rank {rank}, every rank changed hidden{tag}: {name}")
    _agreeing_round(sides, Inputs(gen, dev), rank, "every rank changed hidden, and back" + tag)
    for s in sides:
        s.buf.destroy()
    if puts:
        from deepcomm.cuda import nvshmem_session
        nvshmem_session.finalize()


def test_a_low_latency_shape_changed_on_one_rank_raises_on_every_rank():
    run_on_gpus(_shape_worker, WORLD, timeout_s=scaled(600))


@pytest.mark.skipif(not has_nvshmem_wheel(),
                    reason="nvidia.nvshmem is not importable (pip install nvidia-nvshmem-cu13)")
def test_a_low_latency_shape_changed_on_one_rank_through_puts_raises_on_every_rank():
    run_on_gpus(_shape_worker, WORLD, True, timeout_s=scaled(600))


def _mode_cases(rank, me, dev):
    """A normal-mode call on the other ranks met by a low-latency call on rank ``me``, or the other way round: the
    kinds meet in each other's agree slots (deepcomm/cuda/mode_meet.py). (what, call(side))."""
    odd = rank == me
    inp = Inputs(torch.Generator().manual_seed(41 + rank), dev)
    ll_dispatch = lambda s: s.buf.low_latency_dispatch(inp.x, inp.idx, M, E, use_fp8=False)  # noqa: E731
    return [
        ("fresh dispatch vs low-latency dispatch",
         lambda s: ll_dispatch(s) if odd else s.buf.dispatch(inp.x, inp.idx, inp.w, num_experts=E)),
        ("cached dispatch vs low-latency dispatch",
         lambda s: ll_dispatch(s) if odd else s.buf.dispatch(inp.x, handle=s.handle, topk_weights=inp.w)),
        ("combine vs low-latency combine",
         lambda s: s.buf.low_latency_combine(s.ll_x, s.ll_idx, s.ll_w, s.ll_handle) if odd
         else s.buf.combine(s.recv_x, s.handle, s.recv_w)),
        ("low-latency dispatch vs fresh dispatch",
         lambda s: s.buf.dispatch(inp.x, inp.idx, inp.w, num_experts=E) if odd else ll_dispatch(s)),
        ("low-latency combine vs combine",
         lambda s: s.buf.combine(s.recv_x, s.handle, s.recv_w) if odd
         else s.buf.low_latency_combine(s.ll_x, s.ll_idx, s.ll_w, s.ll_handle)),
    ]


def _meet_then_agree(sides, call, rank, what, gen, dev):
    """``call`` raises the reference backend's text on every rank; then every kind of call on the same Buffers, twice,
    bit-exact: both modes' call numbers are in step again."""
    _expect_disagreement(sides, call, rank, what)
    _agreeing_round(sides, Inputs(gen, dev), rank, what)
    _agreeing_round(sides, Inputs(gen, dev), rank, f"{what}, a second round")


def _mode_worker(rank, world):
    dev = worker_device(rank)
    sides = _buffers(dev)
    gen = torch.Generator().manual_seed(4000 + rank)
    _agreeing_round(sides, Inputs(gen, dev), rank, "the start")
    for what, call in _mode_cases(rank, world - 1, dev):
        _meet_then_agree(sides, call, rank, what, gen, dev)
    for s in sides:
        s.buf.destroy()


def test_a_normal_call_meeting_a_low_latency_call_raises_on_every_rank():
    run_on_gpus(_mode_worker, WORLD, timeout_s=scaled(600))


def _first_call_cases(rank, me, dev):
    """A normal-mode call on the other ranks met by a Buffer's first low-latency call on rank ``me`` (it makes the
    low-latency buffer, ModeMeet.first_low_latency_call), or the other way round, or by a first low-latency call
    that ``me`` rejected: (what, whether the ranks need a handle first, call(side)). Each runs on new Buffers."""
    odd = rank == me
    inp = Inputs(torch.Generator().manual_seed(61 + rank), dev)
    ll = lambda s, x=inp.x: s.buf.low_latency_dispatch(x, inp.idx, M, E, use_fp8=False)  # noqa: E731
    fresh = lambda s: s.buf.dispatch(inp.x, inp.idx, inp.w, num_experts=E)  # noqa: E731
    return [
        ("fresh dispatch vs the first low-latency dispatch", False, lambda s: ll(s) if odd else fresh(s)),
        ("the first low-latency dispatch vs fresh dispatch", False, lambda s: fresh(s) if odd else ll(s)),
        ("combine vs the first low-latency dispatch", True,
         lambda s: ll(s) if odd else s.buf.combine(s.recv_x, s.handle, s.recv_w)),
        ("fresh dispatch vs a rejected first low-latency dispatch", False,
         lambda s: ll(s, inp.x.float()) if odd else fresh(s)),
    ]


def _first_call_worker(rank, world):
    dev = worker_device(rank)
    gen = torch.Generator().manual_seed(5000 + rank)
    for what, with_handle, call in _first_call_cases(rank, world - 1, dev):
        sides = _buffers(dev)  # no low-latency buffer yet
        if with_handle:
            inp = Inputs(gen, dev)
            for s in sides:
                s.recv_x, _, s.recv_w, _, s.handle = s.buf.dispatch(inp.x, inp.idx, inp.w, num_experts=E)
        _meet_then_agree(sides, call, rank, what, gen, dev)  # the agreeing rounds make the low-latency buffer
        for s in sides:
            s.buf.destroy()


def test_a_normal_call_meeting_the_first_low_latency_call_raises_on_every_rank():
    run_on_gpus(_first_call_worker, WORLD, timeout_s=scaled(600))


def _later_call_cases(rank, me, dev):
    """A normal-mode call on the other ranks met by a later low-latency call on rank ``me`` (the low-latency buffer
    exists): one of a new shape, which remakes the buffer, or one ``me`` rejected; or the other way round.
    (what, call(side)). Each runs on new Buffers after an agreeing round of both modes."""
    odd = rank == me
    inp = Inputs(torch.Generator().manual_seed(71 + rank), dev)
    narrow = Inputs(torch.Generator().manual_seed(81 + rank), dev, hidden=H // 2)
    ll = lambda s, x=inp.x, idx=inp.idx: s.buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)  # noqa: E731
    fresh = lambda s: s.buf.dispatch(inp.x, inp.idx, inp.w, num_experts=E)  # noqa: E731
    return [
        ("fresh dispatch vs a low-latency dispatch of a new hidden",
         lambda s: ll(s, narrow.x, narrow.idx) if odd else fresh(s)),
        ("a low-latency dispatch of a new hidden vs fresh dispatch",
         lambda s: fresh(s) if odd else ll(s, narrow.x, narrow.idx)),
        ("fresh dispatch vs a rejected low-latency dispatch", lambda s: ll(s, inp.x.float()) if odd else fresh(s)),
    ]


def _later_call_worker(rank, world):
    dev = worker_device(rank)
    gen = torch.Generator().manual_seed(6000 + rank)
    for what, call in _later_call_cases(rank, world - 1, dev):
        sides = _buffers(dev)
        _agreeing_round(sides, Inputs(gen, dev), rank, f"{what}: before")  # makes the low-latency buffer
        _meet_then_agree(sides, call, rank, what, gen, dev)
        for s in sides:
            s.buf.destroy()


def test_a_normal_call_meeting_a_later_low_latency_call_raises_on_every_rank():
    run_on_gpus(_later_call_worker, WORLD, timeout_s=scaled(600))



PUT_TIMEOUT_S = 6.0


def _puts_mode_worker(rank, world):
    """Every peer reached by NVSHMEM puts: a fresh dispatch on rank 0 met by a low-latency dispatch on the others is
    not compared by any exchange (docs/troubleshooting.md, "Not caught"). Each rank's call must end in a
    CommTimeoutError that names the stage at which the peer it waited for gave up (that peer's own timeout, read
    from the failure board); a Buffer built again on every rank then runs an agreeing round bit for bit."""
    import torch.distributed as dist
    import deepcomm
    dev = worker_device(rank, puts=True)
    gen = torch.Generator().manual_seed(5000 + rank)
    buf = cuda_buffer(num_sms=8, max_tokens_per_rank=4 * T, hidden=H, num_max_low_latency_tokens=M,
                      timeout_s=PUT_TIMEOUT_S)
    inp = Inputs(gen, dev)
    _round(Side("cuda", buf), inp)  # makes the low-latency buffer
    buf.synchronize()
    assert buf._backend.ll.buffer.put_peers == [p for p in range(world) if p != rank]
    with pytest.raises(deepcomm.CommTimeoutError) as info:
        if rank == 0:
            buf.dispatch(inp.x, inp.idx, inp.w, num_experts=E)
        else:
            buf.low_latency_dispatch(inp.x, inp.idx, M, E, use_fp8=False)
        buf.synchronize()
    err = info.value
    store = dist.distributed_c10d._get_default_store()
    store.set(f"puts-mode-stage/{rank}", err.stage)
    assert err.peer is not None and err.peer != rank, str(err)
    peer_stage = store.get(f"puts-mode-stage/{err.peer}").decode()
    said = str(err).split(f"rank {err.peer} reported: ", 1)
    assert len(said) == 2, f"rank {rank}: the timeout names nothing peer {err.peer} reported: {err}"
    assert said[1].startswith(f"deepcomm: rank {err.peer} timed out") and f"at stage '{peer_stage}'" in said[1], \
        f"rank {rank}: {err}"
    buf.destroy()
    dist.barrier()
    fresh = _buffers(dev)
    _agreeing_round(fresh, Inputs(gen, dev), rank, "a rebuild after the timeout (puts)")
    for s in fresh:
        s.buf.destroy()
    from deepcomm.cuda import nvshmem_session
    nvshmem_session.finalize()


@pytest.mark.skipif(not has_nvshmem_wheel(),
                    reason="nvidia.nvshmem is not importable (pip install nvidia-nvshmem-cu13)")
def test_a_normal_call_meeting_a_low_latency_call_through_puts_times_out_naming_each_stage():
    run_on_gpus(_puts_mode_worker, WORLD, timeout_s=scaled(600))
