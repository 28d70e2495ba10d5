"""Worst-case-size dispatch (num_worst_tokens: no host sync, graph-capturable on GPU) on the reference backend:
the real rows equal a normal dispatch, padding follows, combine and cached re-dispatch take the padded form."""
import pytest
import torch

from tests.helpers.multiproc import run_ranks


def _worker(rank, world):
    import deepcomm
    from deepcomm.fp8 import per_token_cast_to_fp8

    buf = deepcomm.Buffer(max_tokens_per_rank=64, hidden=256, backend="reference")
    gen = torch.Generator().manual_seed(rank + 5)
    T, H, E, K = (13, 40)[rank], 256, 8, 3
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    idx[torch.rand(T, K, generator=gen) < 0.2] = -1
    w = torch.rand(T, K, generator=gen)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    W = world * 64

    plain = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=2)
    worst = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=2, num_worst_tokens=W)
    n = plain[4].num_recv
    assert worst[0].shape == (W, H) and worst[4].num_recv == W
    assert torch.equal(worst[0][:n], plain[0]) and torch.equal(worst[1][:n], plain[1])
    assert torch.equal(worst[2][:n], plain[2])
    assert (worst[1][n:] == -1).all()
    assert torch.is_tensor(worst[3]) and worst[3].tolist() == plain[3]

    y = torch.randn(W, H, generator=gen).to(torch.bfloat16)
    rw = torch.rand(W, K, generator=gen)
    got = buf.combine(y, worst[4], topk_weights=rw)
    want = buf.combine(y[:n].contiguous(), plain[4], topk_weights=rw[:n].contiguous())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    again = buf.dispatch(x, handle=worst[4], topk_weights=w)  # a worst-case handle keeps its padded size
    assert again[0].shape == (W, H) and torch.equal(again[0][:n], plain[0])

    vals, scales = per_token_cast_to_fp8(x)
    fp8 = buf.dispatch((vals, scales), topk_idx=idx, num_experts=E, num_worst_tokens=W)
    fp8_plain = buf.dispatch((vals, scales), topk_idx=idx, num_experts=E)
    assert torch.equal(fp8[0][0][:n].view(torch.uint8), fp8_plain[0][0].view(torch.uint8))
    assert torch.equal(fp8[0][1][:n], fp8_plain[0][1])

    with pytest.raises(ValueError, match="num_worst_tokens"):
        buf.dispatch(x, topk_idx=idx, num_experts=E, num_worst_tokens=W + 1)  # over the buffer's maximum
    with pytest.raises(ValueError, match="num_worst_tokens"):
        buf.dispatch(x, topk_idx=idx, num_experts=E, num_worst_tokens=-1)
    with pytest.raises(ValueError, match="previous_event"):
        buf.dispatch(x, topk_idx=idx, num_experts=E, previous_event=object())
    with pytest.raises(ValueError, match="async_finish"):
        buf.combine(y[:n].contiguous(), plain[4], async_finish=1)
    # too small a worst case: every rank must fail the same call, so make it too small everywhere
    with pytest.raises(ValueError, match="num_worst_tokens"):
        buf.dispatch(x, topk_idx=idx, num_experts=E, num_worst_tokens=1)
    assert buf.event is None
    buf.destroy()


def test_worst_case_dispatch_two_ranks():
    run_ranks(_worker, 2)
