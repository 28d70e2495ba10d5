"""Low-latency dispatch + combine in 2 and 3 CPU processes against a brute-force loop."""
import pytest
import torch

from tests.helpers import bruteforce as bf
from tests.helpers.multiproc import run_ranks
from tests.normal.test_normal import _equal, _gather

MAX_TOKENS = 6
HIDDEN = 256

# name, tokens(rank), slots, experts per rank, use_fp8, use_ue8m0, return_recv_hook
SCENARIOS = [
    ("bf16", lambda r: 5 - r, 3, 2, False, False, False),
    ("fp8", lambda r: MAX_TOKENS, 2, 3, True, False, False),
    ("fp8-ue8m0-hook", lambda r: 0 if r == 1 else 4, 4, 2, True, True, True),
    ("bf16-hook-one-token", lambda r: 1, 1, 1, False, False, True),
]


def _ll_worker(rank, world):
    import deepcomm
    buf = deepcomm.Buffer(max_tokens_per_rank=64, hidden=HIDDEN, num_max_low_latency_tokens=8, timeout_s=60)
    for seed, (name, tokens, slots, per_rank, use_fp8, use_ue8m0, hook_mode) in enumerate(SCENARIOS):
        what = f"[{name} rank {rank}/{world}]"
        experts = per_rank * world
        gen = torch.Generator().manual_seed(100 * seed + rank)
        idx = bf.make_topk(gen, tokens(rank), slots, experts, p_empty=0.25)
        w = torch.rand(idx.shape, generator=gen)
        x = (torch.randn(idx.shape[0], HIDDEN, generator=gen) * 3).to(torch.bfloat16)
        xs, idxs, ws = zip(*_gather((x, idx, w), world))

        recv_x, recv_count, handle, hook = buf.low_latency_dispatch(
            x, idx, MAX_TOKENS, experts, use_fp8=use_fp8, use_ue8m0=use_ue8m0, return_recv_hook=hook_mode)
        hook()
        hook()  # calling a hook twice is harmless
        rows = world * MAX_TOKENS
        want = bf.ll_dispatch(rank, xs, idxs, experts, MAX_TOKENS, use_fp8, use_ue8m0)
        assert recv_count.dtype == torch.int32 and recv_count.tolist() == [len(e[0]) for e in want], what
        _equal(handle.recv_pos, bf.ll_recv_pos(rank, idxs, experts), f"{what} recv_pos")
        assert handle.layout.shape == (per_rank, world, 2) and handle.src_info.shape == (per_rank, rows)
        for e, (entries, payload, src_tokens, layout_rows) in enumerate(want):
            n = len(entries)
            if use_fp8:
                assert recv_x[0].shape == (per_rank, rows, HIDDEN) and recv_x[1].shape == (per_rank, rows, 2)
                _equal(recv_x[0][e, :n], payload[0], f"{what} expert {e} values")
                _equal(recv_x[1][e, :n], payload[1], f"{what} expert {e} scales")
            else:
                assert recv_x.shape == (per_rank, rows, HIDDEN)
                _equal(recv_x[e, :n], payload, f"{what} expert {e} rows")
            assert handle.src_info[e, :n].tolist() == src_tokens, f"{what} src_info"
            assert handle.layout[e].tolist() == layout_rows, f"{what} layout"

        # expert outputs: a function of the received rows, garbage past the counts
        got = deepcomm.fp8.per_token_cast_back(*recv_x) if use_fp8 else recv_x.float()
        y = (got * torch.arange(1, per_rank + 1).view(-1, 1, 1) + rank).to(torch.bfloat16)
        for e in range(per_rank):
            y[e, int(recv_count[e]):] = torch.randn(rows - int(recv_count[e]), HIDDEN, generator=gen).bfloat16()
        ys = _gather(y, world)
        combined, chook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook_mode)
        chook()
        _equal(combined, bf.ll_combine(rank, ys, idxs, ws, experts), f"{what} combined")
        combined8, chook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook_mode, use_fp8=True)
        chook()
        _equal(combined8, bf.ll_combine(rank, ys, idxs, ws, experts, use_fp8=True), f"{what} combined fp8")
        if ((idx >= 0) & (idx // per_rank != rank)).any():  # some partial crossed ranks: FP8 must show
            assert not torch.equal(combined8, combined), f"{what}: the FP8 combine changed nothing"
        with pytest.raises(ValueError, match="^use_fp8"):
            buf.low_latency_combine(y, idx, w, handle, use_fp8=1)
    buf.destroy()
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_low_latency_matches_brute_force(world):
    assert run_ranks(_ll_worker, world) == [True] * world
