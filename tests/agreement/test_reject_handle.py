"""A rejected call hands its handle argument to the backend's ``reject`` (Buffer._reject): the CUDA backend's
low-latency combine of an older handle joins that handle's buffer slot (deepcomm/cuda/ll_calls.py), not the
latest dispatch's. Checked on 2 gloo processes with the reference backend, whose reject records what it got;
the slot itself is exercised on the GPU in tests/agreement/test_agree_internode_gpu.py."""
from __future__ import annotations

import torch

from tests.helpers.multiproc import run_ranks

H, E, M = 128, 8, 8


def _worker(rank, world):
    import deepcomm
    buf = deepcomm.Buffer(backend="reference", hidden=H, max_tokens_per_rank=M, num_max_low_latency_tokens=M,
                          timeout_s=30.0)
    got = []
    real = buf._backend.reject
    buf._backend.reject = lambda words, handle=None: (got.append(handle), real(words, handle=handle))[1]
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(4, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(4)])
    w = torch.rand(4, 2, generator=gen)
    recv_a, _, older, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    recv_b, _, latest, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    bad_w = w.to(torch.float64) if rank == 1 else w
    try:
        buf.low_latency_combine(recv_a, idx, bad_w, older)
        error = None
    except ValueError as e:
        error = str(e)
    # the Buffer goes on: a combine of the latest handle on every rank works
    buf.low_latency_combine(recv_b, idx, w, latest)
    buf.destroy()
    return error, [h is older for h in got], [h is latest for h in got], older.call


def test_a_rejected_combine_hands_its_own_handle_to_the_backend():
    (e0, older0, _, call), (e1, older1, latest1, _) = run_ranks(_worker, 2)
    assert older0 == [] and older1 == [True] and latest1 == [False]
    assert e1.startswith("topk_weights: "), e1
    assert e0 == (f"topk_weights: rank 1 rejected low_latency_combine call #{call + 2} on this Buffer (see that "
                  "rank's error); no rank ran the call"), e0
