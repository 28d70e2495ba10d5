"""Never hang: a peer that never calls, or that is killed between rounds, makes the other rank raise
CommTimeoutError naming rank, peer and stage, in normal and in low-latency mode. After a timeout the Buffer refuses
work; destroying it and building a fresh one on every rank (docs/troubleshooting.md) gives exact results again."""
from __future__ import annotations

import time

import pytest
import torch

from tests.helpers.fault_run import die, run_with_faults
from tests.helpers.nccl_run import needs_ranks, run_on_gpus

pytestmark = [pytest.mark.gpu, needs_ranks(2)]

TIMEOUT_S = 3.0
T, H, E, K, M = 48, 1024, 16, 2, 64
# Where the first wait on a silent peer is, per mode. Low-latency dispatch waits first for the peer's counts, or
# (kernels that send data without a count exchange) for the peer's data: either is a dispatch wait on peer 1.
# a call's first wait is for its peers' fingerprints (the agreement word of its first exchange), then its data
AGREE = "agree (waiting for a peer's call fingerprint: it has not reached this call)"
STAGES = {"normal": (AGREE, "notify:counts"),
          "low_latency": (AGREE, "low_latency_dispatch:counts", "low_latency_dispatch:data")}


def _buffer():
    import deepcomm
    return deepcomm.Buffer(max_tokens_per_rank=T, hidden=H, backend="cuda", num_max_low_latency_tokens=M,
                           num_sms=4, timeout_s=TIMEOUT_S)


def _inputs(gen, dev):
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.to(dev)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
    w = torch.rand(T, K, generator=gen).to(dev)
    return x, idx, w


def _good_round(buf, mode, gen) -> None:
    """One dispatch + combine with a result known without the peer's data."""
    x, idx, w = _inputs(gen, buf.device)
    if mode == "normal":
        recv_x, _, _, _, handle = buf.dispatch(x, topk_idx=idx, num_experts=E)
        out, _ = buf.combine(recv_x, handle)
        # every copy comes back unchanged: the fp32 sum of n equal bf16 values is exact, so n * x bit for bit
        copies = handle.is_token_in_rank.sum(dim=1, dtype=torch.float32)
        assert torch.equal(out, (x.float() * copies[:, None]).to(torch.bfloat16)), "normal round"
    else:
        recv_x, _, handle, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        out, _ = buf.low_latency_combine(recv_x, idx, w, handle)
        want = x.float() * w.sum(dim=1, keepdim=True)  # sum_k w_k x (rounding order differs: close, not equal)
        assert torch.allclose(out.float(), want, rtol=2e-2, atol=2e-2), "low-latency round"


def _call_without_peer(buf, mode, gen) -> None:
    """The call that waits for the silent peer; low-latency mode has no host sync, so synchronize() reports."""
    x, idx, _ = _inputs(gen, buf.device)
    if mode == "normal":
        buf.dispatch(x, topk_idx=idx, num_experts=E)
    else:
        buf.low_latency_dispatch(x, idx, M, E, use_fp8=True)
        buf.synchronize()


def _expect_timeout(buf, mode, gen) -> None:
    import deepcomm
    start = time.monotonic()
    with pytest.raises(deepcomm.CommTimeoutError) as info:
        _call_without_peer(buf, mode, gen)
    err = info.value
    assert (err.rank, err.peer) == (0, 1) and err.stage in STAGES[mode], str(err)
    assert "rank 0" in str(err) and "peer 1" in str(err) and f"'{err.stage}'" in str(err), str(err)
    # bounded by the Buffer's timeout (plus launch and host overhead), not by any outer deadline
    assert time.monotonic() - start < TIMEOUT_S + 30, "the timeout took far longer than timeout_s"
    with pytest.raises(RuntimeError, match="communication timeout"):  # a timed-out Buffer refuses work
        _good_round(buf, mode, gen)


def _missing_peer_worker(rank, world, mode):
    import torch.distributed as dist
    gen = torch.Generator().manual_seed(11 + rank)
    buf = _buffer()
    _good_round(buf, mode, gen)  # both ranks: also makes the low-latency buffer (a collective)
    if rank == 0:
        _expect_timeout(buf, mode, gen)
    # rank 1 never made the call; it waits here until rank 0 gave up (rank 0's kernel wrote into our buffer)
    dist.barrier()
    buf.destroy()
    # Recovery as documented: every rank destroys its Buffer and builds a new one.
    fresh = _buffer()
    for _ in range(3):
        _good_round(fresh, mode, gen)
    fresh.synchronize()
    fresh.destroy()


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_missing_peer_times_out_then_a_fresh_buffer_works(mode):
    run_on_gpus(_missing_peer_worker, 2, mode, timeout_s=180)


def _killed_peer_worker(rank, world, mode):
    gen = torch.Generator().manual_seed(21 + rank)
    buf = _buffer()
    for _ in range(3):
        _good_round(buf, mode, gen)
    # Both ranks finished every kernel of those rounds (each waits for its peer's writes), so rank 1 dies between
    # calls, before the next dispatch.
    torch.cuda.synchronize()
    if rank == 1:
        die()
    _expect_timeout(buf, mode, gen)
    buf.destroy()  # local, no collective: safe with the peer gone; nothing after this touches the process group


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_killed_peer_times_out(mode):
    run_with_faults(_killed_peer_worker, 2, mode, killed=(1,), deadline_s=150)


class _FailingLaunch:
    """Stands in for a rank's NvlContext: its dispatch crossing fails as a failed kernel launch would (after the
    call was counted as joined); everything else goes to the real context."""

    def __init__(self, real):
        self.real = real

    def dispatch_into(self, *args):
        raise RuntimeError("simulated launch failure")

    dispatch_call = dispatch_into

    def __getattr__(self, name):
        return getattr(self.real, name)


def _failed_launch_worker(rank, world):
    import torch.distributed as dist
    import deepcomm
    gen = torch.Generator().manual_seed(31 + rank)
    buf = _buffer()
    _good_round(buf, "normal", gen)
    x, idx, _ = _inputs(gen, buf.device)
    if rank == 1:
        buf._backend.nvl.ctx = _FailingLaunch(buf._backend.nvl.ctx)
        with pytest.raises(RuntimeError, match="simulated launch failure"):
            buf.dispatch(x, topk_idx=idx, num_experts=E)
        with pytest.raises(RuntimeError, match="failed inside its crossing"):  # this Buffer takes no more calls
            buf.dispatch(x, topk_idx=idx, num_experts=E)
    else:
        with pytest.raises(deepcomm.CommTimeoutError) as info:
            buf.dispatch(x, topk_idx=idx, num_experts=E)
        text = str(info.value)
        assert "rank 1 reported: deepcomm: this Buffer's dispatch failed inside its crossing" in text, text
        assert "simulated launch failure" in text, text
    dist.barrier()  # rank 1 stays until rank 0 timed out (its kernel wrote into our buffer)
    buf.destroy()


def test_a_peer_whose_launch_failed_is_named_in_the_timeout():
    """A rank whose dispatch fails inside its crossing (after its exchange may have begun) says why on the failure
    board (deepcomm/failure_board.py); the rank that waited for it times out naming that reason."""
    run_on_gpus(_failed_launch_worker, 2, timeout_s=120)
