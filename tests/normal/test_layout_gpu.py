"""The CUDA backend's get_dispatch_layout (csrc/kernels/layout.cu) against the reference layout math, bit for bit:
token counts that use one block, several, and more than the block cap (each block then takes several chunks);
random, masked, duplicate-slot and all-empty routings. Expert ids outside [-1, E) must count nowhere, never be
written through, and raise ValueError naming topk_idx and their number at the rank's next call on the Buffer or
synchronize(), leaving the Buffer usable. At world size 1 and at ranks_for_tests() ranks (shared mode too)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.nccl_run import cuda_buffer, gpu_count, needs_ranks, rank_device, ranks_for_tests, run_on_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")]

# 128 tokens per block, at most 256 blocks (csrc/kernels/layout.cu): 0, one block, its edges, several, and past the
# cap (40000 tokens: 313 chunks on 256 blocks)
TOKENS = (0, 1, 63, 64, 65, 127, 128, 129, 300, 4096, 40000)


def _routing(gen, T, E, K, mode):
    if mode == "empty":
        return torch.full((T, K), -1, dtype=torch.int64)
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    if mode == "masked":
        idx[torch.rand(T, K, generator=gen) < 0.3] = -1
    if mode == "dup" and K > 1:  # two slots naming one expert: counted once per token
        idx[:, 1] = idx[:, 0]
    return idx


def _expected(idx, E, world):
    from deepcomm import layout
    valid = torch.where((idx >= -1) & (idx < E), idx, torch.full_like(idx, -1))  # bad ids count nowhere
    return layout.get_dispatch_layout(valid, E, world)


def _same_layout(got, want, what):
    for name, a, b in zip(("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what} {name}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        assert torch.equal(a, b), f"{what} {name} differs"


def _layout_worker(rank, world):
    dev = rank_device(rank)
    gen = torch.Generator().manual_seed(99 + rank)
    buf = cuda_buffer(max_tokens_per_rank=256, hidden=1024, timeout_s=20)
    # (experts, topk, routing mode)
    shapes = [(256 if 256 % world == 0 else 32 * world, 8, "random"), (16 * world, 4, "masked"), (8 * world, 3, "dup"),
              (4 * world, 1, "random"), (32 * world, 32, "masked"), (2 * world, 2, "empty")]
    for T in TOKENS:
        for E, K, mode in shapes:
            K = min(K, E)
            idx = _routing(gen, T, E, K, mode).to(dev)
            what = f"rank {rank}/{world} T={T} E={E} K={K} {mode}"
            _same_layout(buf.get_dispatch_layout(idx, E), _expected(idx, E, world), what)
    buf.synchronize()  # nothing was recorded

    # bad ids: huge ones too (an index computed from them would land far outside every output)
    E, K = 16 * world, 4
    for T in (1, 65, 4096):
        idx = _routing(gen, T, E, K, "masked").contiguous()
        flat = idx.view(-1)
        spots = torch.randperm(flat.numel(), generator=gen)[:min(5, flat.numel())]
        bad_values = torch.tensor([E, -2, 2 ** 40, -(2 ** 40), E + 1])[:spots.numel()]
        flat[spots] = bad_values
        idx = idx.to(dev)
        got = buf.get_dispatch_layout(idx, E)  # no host sync: nothing raised yet
        torch.cuda.synchronize(dev)
        _same_layout(got, _expected(idx, E, world), f"rank {rank} T={T} with bad ids")
        n_bad = spots.numel()
        with pytest.raises(ValueError, match=rf"^topk_idx: .*get_dispatch_layout.* {n_bad} expert ids outside"):
            buf.synchronize()
        buf.synchronize()  # raised once; the Buffer stays usable
        ok = _routing(gen, 33, E, K, "random").to(dev)
        _same_layout(buf.get_dispatch_layout(ok, E), _expected(ok, E, world), f"rank {rank} after bad ids")

    # raised at the next call on the Buffer: here the next get_dispatch_layout
    bad = torch.full((3, 2), E, dtype=torch.int64, device=dev)
    buf.get_dispatch_layout(bad, E)
    torch.cuda.synchronize(dev)
    with pytest.raises(ValueError, match=r"^topk_idx: .* 6 expert ids outside"):
        buf.get_dispatch_layout(ok, E)
    _same_layout(buf.get_dispatch_layout(ok, E), _expected(ok, E, world), f"rank {rank} next layout")
    buf.synchronize()

    # a fresh dispatch of the same bad ids stops on every rank at once (its own check); the layout's record joins
    # that error instead of raising again later
    x = torch.randn(4, 1024).to(torch.bfloat16).to(dev)
    idx = torch.tensor([[0, 1], [2, -1], [1, 0], [3, 2]], dtype=torch.int64)
    if rank == 0:
        idx[1, 1] = E + 3
    idx = idx.to(dev)
    buf.get_dispatch_layout(idx, E)
    with pytest.raises(ValueError, match=r"^topk_idx: "):
        buf.dispatch(x, topk_idx=idx, num_experts=E)
    buf.synchronize()  # nothing left over
    good = torch.where(idx < E, idx, torch.full_like(idx, -1))
    recv = buf.dispatch(x, topk_idx=good, num_experts=E)  # every rank still in step
    # experts 0..3 live on rank 0 (16 per rank): every rank's 4 tokens go there
    assert recv[4].num_recv == (4 * world if rank == 0 else 0), recv[4].num_recv
    buf.synchronize()
    buf.destroy()


def test_layout_matches_reference_at_world_size_1():
    run_on_gpus(_layout_worker, 1)


@needs_ranks(2)
def test_layout_matches_reference_on_several_ranks():
    run_on_gpus(_layout_worker, ranks_for_tests())
