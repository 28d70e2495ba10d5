"""deepcomm.moe: the MoE layer in 2 and 3 CPU processes against one process holding every expert (float64).

Forward output and the gradients of the input, the router weight and the expert weights must match the dense
computation on the all-gathered inputs and parameters; the fused dispatch/combine helpers are checked on a hand
routing (duplicate slots, -1 slots, alignment padding); a short training run must lower the loss.
"""
import importlib.util
import os

import pytest
import torch

from tests.helpers.multiproc import run_ranks
from tests.normal.test_normal import _gather
from tests.helpers.paths import ROOT

HIDDEN, FFN, PER_RANK, TOPK = 16, 24, 2, 3


def _global_params(world):
    gen = torch.Generator().manual_seed(1234)
    experts = PER_RANK * world
    router = torch.randn(experts, HIDDEN, generator=gen, dtype=torch.float64)
    w1 = torch.randn(experts, HIDDEN, 2 * FFN, generator=gen, dtype=torch.float64) / HIDDEN ** 0.5
    w2 = torch.randn(experts, FFN, HIDDEN, generator=gen, dtype=torch.float64) / FFN ** 0.5
    return router, w1, w2


def _dense(world, xs, gs, params):
    from deepcomm.moe import dense_moe
    router, w1, w2 = params
    xs = [x.clone().requires_grad_() for x in xs]
    routers = [router.clone().requires_grad_() for _ in range(world)]  # one replica per rank
    w1, w2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    ys = [dense_moe(xs[s], routers[s], w1, w2, TOPK) for s in range(world)]
    sum((y * g).sum() for y, g in zip(ys, gs)).backward()
    return ys, [x.grad for x in xs], [r.grad for r in routers], w1.grad, w2.grad


def _layer_worker(rank, world, alignments):
    for alignment in alignments:
        _check_layer(rank, world, alignment)
    return True


def _check_layer(rank, world, alignment):
    import deepcomm
    from deepcomm.moe import MoELayer
    tokens = [5, 0, 7][rank] if world == 3 else [6, 9][rank]
    gen = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(tokens, HIDDEN, generator=gen, dtype=torch.float64)
    g = torch.randn(tokens, HIDDEN, generator=gen, dtype=torch.float64)
    params = _global_params(world)
    xs, gs = zip(*_gather((x, g), world))

    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=HIDDEN)
    layer = MoELayer(buf, HIDDEN, FFN, PER_RANK * world, TOPK, expert_alignment=alignment, dtype=torch.float64)
    with torch.no_grad():
        layer.router.weight.copy_(params[0])
    layer.load_global_experts(params[1], params[2])
    x_leaf = x.clone().requires_grad_()
    y = layer(x_leaf)
    (y * g).sum().backward()

    want_y, want_gx, want_grouter, want_g1, want_g2 = _dense(world, list(xs), list(gs), params)
    sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    tol = dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y, want_y[rank].detach(), **tol)
    torch.testing.assert_close(x_leaf.grad, want_gx[rank], **tol)
    torch.testing.assert_close(layer.router.weight.grad, want_grouter[rank], **tol)
    torch.testing.assert_close(layer.w_gate_up.grad, want_g1[sl], **tol)
    torch.testing.assert_close(layer.w_down.grad, want_g2[sl], **tol)
    assert all(int(c) % alignment == 0 for c in layer.last_tokens_per_expert)
    # inference (no autograd recorded: the Buffer's own calls) gives the same forward
    with torch.no_grad():
        y_inf = layer(x_leaf)
    assert not y_inf.requires_grad
    torch.testing.assert_close(y_inf, want_y[rank].detach(), **tol)
    # the replicated router's summed gradient is the gradient of the sum of all ranks' losses
    layer.sync_replicated_grads()
    torch.testing.assert_close(layer.router.weight.grad, sum(want_grouter), **tol)
    buf.destroy()


@pytest.mark.parametrize("world,alignments", [(2, (1, 4)), (3, (1,))])
def test_layer_matches_dense(world, alignments):
    assert run_ranks(_layer_worker, world, alignments) == [True] * world


def _fused_worker(rank, world):
    import deepcomm
    from deepcomm.moe import fused_combine, fused_dispatch
    hidden, experts = 8, 4  # 2 local experts per rank
    # token 0: experts 0, 0 (a duplicate), 3; token 1: -1, 2; token 2: 1, -1; token 3: nothing
    idx = torch.tensor([[0, 0, 3], [-1, 2, -1], [1, -1, -1], [-1, -1, -1]])
    w = torch.tensor([[0.25, 0.5, 0.25], [0.0, 1.0, 0.0], [0.75, 0.0, 0.0], [0.0, 0.0, 0.0]])
    x = torch.arange(4 * hidden, dtype=torch.float64).view(4, hidden) + 100 * rank
    buf = deepcomm.Buffer(max_tokens_per_rank=8, hidden=hidden)
    permuted, per_expert, probs, ctx = fused_dispatch(buf, x, idx, w, experts, expert_alignment=3)
    assert per_expert.dtype == torch.int64 and per_expert.device.type == "cpu"
    # every rank sends the same routing; received rows are ordered by source rank, then token
    src = [x + 100 * s - 100 * rank for s in range(world)]
    pad = torch.zeros(hidden, dtype=torch.float64)
    if rank == 0:   # expert 0: token 0 of each rank; expert 1: token 2 of each rank (groups padded to 3 rows)
        want_rows = [src[0][0], src[1][0], pad, src[0][2], src[1][2], pad]
        want_probs = [0.75, 0.75, 0.0, 0.75, 0.75, 0.0]
    else:           # expert 2 (local 0): token 1 of each rank; expert 3 (local 1): token 0 of each rank
        want_rows = [src[0][1], src[1][1], pad, src[0][0], src[1][0], pad]
        want_probs = [1.0, 1.0, 0.0, 0.25, 0.25, 0.0]
    assert per_expert.tolist() == [3, 3]
    torch.testing.assert_close(permuted, torch.stack(want_rows), rtol=0, atol=0)
    torch.testing.assert_close(probs, torch.tensor(want_probs), rtol=0, atol=0)
    # identity experts with the weights applied: every token gets back sum_k w[t, k] * x[t]
    y = fused_combine(buf, permuted * probs.double().unsqueeze(1), ctx)
    torch.testing.assert_close(y, x * w.sum(1, keepdim=True).double(), rtol=0, atol=1e-12)
    buf.destroy()
    return True


def test_fused_dispatch_combine_hand_routing():
    assert run_ranks(_fused_worker, 2) == [True, True]


def _load_example():
    spec = importlib.util.spec_from_file_location("train_moe", os.path.join(ROOT, "examples", "train_moe.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_worker(rank, world):
    example = _load_example()
    args = example.parse_args(["--steps", "60", "--tokens", "64", "--log-every", "0"])
    return example.train(rank, world, args)


def test_training_loss_falls():
    losses = run_ranks(_train_worker, 2)
    first, last = losses[0][0], losses[0][-1]
    assert losses[0] == losses[1]           # the printed loss is the all-reduced one
    assert last < 0.6 * first, f"loss went from {first:.4f} to {last:.4f}"
