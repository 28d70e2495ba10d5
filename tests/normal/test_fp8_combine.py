"""FP8 combine on the reference backend (2 and 3 CPU ranks) against a per-token brute force of the documented math:
rows from other ranks pass through per_token_cast_to_fp8 / per_token_cast_back, our own rows stay exact, fp32 sum
ranks ascending, one rounding. Also: the error stays within the e4m3 bound, and the autograd op's backward is
the BF16 dispatch of the gradient (straight-through)."""
import pytest
import torch

from tests.helpers import bruteforce as bf
from tests.helpers.multiproc import run_ranks
from tests.normal.test_normal import _gather

H, SLOTS, PER_RANK = 256, 3, 2


def _ugly_rows(gen, n):
    """bf16 rows mixing plain values, all-zero 128-blocks, huge and tiny magnitudes, and exact ties."""
    y = torch.randn(n, H, generator=gen) * 3
    if n:
        y[0, :128] = 0.0                       # a zero block: scale from the 1e-4 floor
        y[-1, 128:] *= 1e4                     # large block
        y[n // 2, :128] *= 1e-6                # values far below the block's e4m3 subnormal range
        y[:, 5] = 448.0                        # an element that lands exactly on the e4m3 maximum in its block
    return y.to(torch.bfloat16)


def _roundtrip(row):
    from deepcomm.fp8 import per_token_cast_back, per_token_cast_to_fp8
    values, scales = per_token_cast_to_fp8(row.unsqueeze(0))
    return per_token_cast_back(values, scales)[0]


def _expected(src, ys, rows_at, idxs, experts):
    world = len(ys)
    out = []
    for t in range(idxs[src].shape[0]):
        acc = torch.zeros(H, dtype=torch.float32)
        for d in bf.ranks_of(idxs[src][t], experts, world):
            row = ys[d][rows_at[d].index((src, t))]
            acc = acc + (row.float() if d == src else _roundtrip(row))
        out.append(acc.to(torch.bfloat16))
    return torch.stack(out) if out else torch.zeros(0, H, dtype=torch.bfloat16)


def _fp8_combine_worker(rank, world):
    import deepcomm
    buf = deepcomm.Buffer(max_tokens_per_rank=64, hidden=H, backend="reference", timeout_s=60)
    experts = PER_RANK * world
    gen = torch.Generator().manual_seed(97 + rank)
    # (tokens on this rank, routing): random with -1 slots, zero tokens on rank 0, everything to one expert
    for tokens, routing in (((9, 7, 5), "random"), ((0, 1, 3), "random"), ((6, 6, 6), "one_expert")):
        T = tokens[rank]
        idx = bf.make_topk(gen, T, SLOTS, experts, p_empty=0.3)
        if routing == "one_expert":
            idx = torch.full_like(idx, -1)
            idx[:, 0] = experts - 1
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
        recv_x, _, _, _, handle = buf.dispatch(x, topk_idx=idx, num_experts=experts)
        y = _ugly_rows(gen, handle.num_recv)
        w = torch.rand(handle.num_recv, SLOTS, generator=gen)
        got, got_w = buf.combine(y, handle, topk_weights=w, use_fp8=True)
        exact, exact_w = buf.combine(y, handle, topk_weights=w)

        xs, idxs, ys = zip(*_gather((x, idx, y), world))
        rows_at = [bf.dispatch(d, xs, idxs, None, experts)[0] for d in range(world)]
        what = f"rank {rank}/{world} tokens {tokens} {routing}"
        want = _expected(rank, ys, rows_at, idxs, experts)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape, what
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{what}: combined_x differs"
        assert torch.equal(got_w, exact_w), f"{what}: weights are reduced in fp32 either way"

        # e4m3 error bound: half an ulp at the top of the block's range is amax/28 per remote row, plus the
        # two final bf16 roundings.
        bound = torch.zeros(T, H)
        remote = torch.zeros(T, dtype=torch.bool)
        for t in range(T):
            for d in bf.ranks_of(idxs[rank][t], experts, world):
                if d != rank:
                    remote[t] = True
                    row = ys[d][rows_at[d].index((rank, t))].float().reshape(-1, 128)
                    bound[t] += (row.abs().amax(dim=1).clamp(min=1e-4) / 28).repeat_interleave(128)
        err = (got.float() - exact.float()).abs()
        assert bool((err <= bound + 2 ** -7 * exact.float().abs()).all()), f"{what}: error above the e4m3 bound"
        if bool(remote.any()):
            assert not torch.equal(got, exact), f"{what}: use_fp8 had no effect on rows from other ranks"
        else:
            assert torch.equal(got, exact), f"{what}: no remote rows, so nothing may change"

    # autograd: forward in FP8, backward = dispatch of the gradient in bf16 (straight-through)
    T = 5
    idx = bf.make_topk(gen, T, SLOTS, experts, p_empty=0.2)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    recv_x, _, _, _, handle = buf.dispatch(x, topk_idx=idx, num_experts=experts)
    y = _ugly_rows(gen, handle.num_recv).requires_grad_(True)
    out, _ = deepcomm.ops.combine(buf, y, handle, use_fp8=True)
    assert torch.equal(out, buf.combine(y.detach(), handle, use_fp8=True)[0])
    g = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    out.backward(g)
    assert torch.equal(y.grad, buf.dispatch(g, handle=handle)[0])
    buf.destroy()
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_fp8_combine_matches_bruteforce(world):
    assert run_ranks(_fp8_combine_worker, world) == [True] * world
