"""deepcomm.ops gradients in float64 against the dense single-process computation.

Per rank d a linear "expert" W_d. Distributed: dispatch -> y = (recv_x @ W_d) * sum_k(recv_w) -> combine
(with recv_w as combine weights). Dense twin for token t of rank s:
    out[t] = sum over ranks d holding any of t's experts of (x[t] @ W_d) * sum_{k on d} w[t, k]
    combined_w[t, k] = w[t, k] if slot k names an expert, else 0
"""
import torch

from tests.helpers import bruteforce as bf
from tests.helpers.multiproc import run_ranks
from tests.normal.test_normal import _gather

HIDDEN, SLOTS, PER_RANK = 16, 3, 2


def _data(rank, world):
    gen = torch.Generator().manual_seed(7 + rank)
    tokens = [4, 0, 6, 5][rank]
    idx = bf.make_topk(gen, tokens, SLOTS, PER_RANK * world, p_empty=0.3)
    x = torch.randn(tokens, HIDDEN, generator=gen, dtype=torch.float64)
    w = torch.rand(tokens, SLOTS, generator=gen)
    W = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(99 + rank), dtype=torch.float64)
    g_out = torch.randn(tokens, HIDDEN, generator=gen, dtype=torch.float64)
    g_w = torch.randn(tokens, SLOTS, generator=gen, dtype=torch.float64)
    return x, idx, w, W, g_out, g_w


def _dense_grads(world, all_data):
    xs = [d[0].clone().requires_grad_() for d in all_data]
    wts = [d[2].clone().requires_grad_() for d in all_data]
    loss = 0
    for s, (_, idx, _, _, g_out, g_w) in enumerate(all_data):
        owner = torch.where(idx >= 0, idx // PER_RANK, torch.full_like(idx, world))
        out = torch.zeros_like(xs[s])
        for d in range(world):
            local_w = torch.where(owner == d, wts[s], torch.zeros_like(wts[s]))
            holds = (owner == d).any(dim=1, keepdim=True)
            out = out + torch.where(holds, (xs[s] @ all_data[d][3]) * local_w.sum(1, keepdim=True).double(), 0.0)
        combined_w = torch.where(idx >= 0, wts[s], torch.zeros_like(wts[s]))
        loss = loss + (out * g_out).sum() + (combined_w.double() * g_w).sum()
    loss.backward()
    return [x.grad for x in xs], [w.grad for w in wts]


def _autograd_worker(rank, world):
    import deepcomm
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=64)
    data = _data(rank, world)
    all_data = _gather(data, world)
    x, idx, w, W, g_out, g_w = data
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    recv_x, recv_idx, recv_w, _, handle = deepcomm.ops.dispatch(buf, x, idx, w, num_experts=PER_RANK * world)
    assert recv_x.requires_grad and recv_w.requires_grad and not recv_idx.requires_grad
    y = (recv_x @ W) * recv_w.sum(1, keepdim=True).double()
    out, combined_w = deepcomm.ops.combine(buf, y, handle, topk_weights=recv_w)
    ((out * g_out).sum() + (combined_w.double() * g_w).sum()).backward()

    want_x, want_w = _dense_grads(world, all_data)
    torch.testing.assert_close(x.grad, want_x[rank], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, want_w[rank], rtol=1e-5, atol=1e-5)

    # gradient wrt x only (no weights anywhere) and an unused recv_x on some rank's path
    x2 = x.detach().clone().requires_grad_()
    recv2, _, none_w, _, h2 = deepcomm.ops.dispatch(buf, x2, idx, None, num_experts=PER_RANK * world)
    assert none_w is None
    out2, none_cw = deepcomm.ops.combine(buf, recv2 * 2.0, h2)
    assert none_cw is None
    (out2 * g_out).sum().backward()
    in_any = (idx >= 0).any(dim=1, keepdim=True).double()
    copies = h2.is_token_in_rank.sum(1, keepdim=True).double()
    torch.testing.assert_close(x2.grad, g_out * 2.0 * copies * in_any, rtol=0, atol=0)

    # gradient wrt the weights only, through recv_topk_weights alone (recv_x unused, x without a gradient): each
    # slot's gradient comes once, from the rank holding its expert; the slots that were not local there get none
    w3 = w.detach().clone().requires_grad_()
    recv3, _, recv_w3, _, _ = deepcomm.ops.dispatch(buf, x.detach(), idx, w3, num_experts=PER_RANK * world)
    assert not recv3.requires_grad and recv_w3.requires_grad
    (recv_w3 * 3.0).sum().backward()
    torch.testing.assert_close(w3.grad, 3.0 * (idx >= 0).float(), rtol=0, atol=0)
    buf.destroy()
    return True


def test_autograd_matches_dense():
    assert run_ranks(_autograd_worker, 3) == [True] * 3


def _no_grad_worker(rank, world):
    """Calls with nothing to differentiate (grad mode off, or no input requiring a gradient) are the Buffer's own
    calls: the same outputs bit for bit, nothing recorded for backward."""
    import deepcomm
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=64)
    x, idx, w, W, _, _ = _data(rank, world)
    E = PER_RANK * world
    want_x, want_idx, want_w, want_counts, want_h = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    want_out, want_cw = buf.combine(want_x @ W, want_h, topk_weights=want_w)
    grad_x, grad_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    for no_grad, xs, ws in ((True, grad_x, grad_w), (False, x, w)):
        with torch.set_grad_enabled(not no_grad):
            recv_x, recv_idx, recv_w, counts, h = deepcomm.ops.dispatch(buf, xs, idx, ws, num_experts=E)
            assert recv_x.grad_fn is None and recv_w.grad_fn is None and not recv_x.requires_grad
            assert counts == want_counts and torch.equal(h.send_pos, want_h.send_pos)
            for got, want in ((recv_x, want_x), (recv_idx, want_idx), (recv_w, want_w)):
                assert torch.equal(got, want)
            out, cw = deepcomm.ops.combine(buf, recv_x @ W, h, topk_weights=recv_w)
            assert out.grad_fn is None and not out.requires_grad
            assert torch.equal(out, want_out) and torch.equal(cw, want_cw)
    buf.destroy()
    return True


def test_calls_without_gradients_are_the_buffer_calls():
    assert run_ranks(_no_grad_worker, 2) == [True] * 2
