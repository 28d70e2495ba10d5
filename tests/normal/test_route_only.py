"""Route-only dispatch (deepcomm/route_only.py): rows go by an is_token_in_rank mask, ids and weights optional.

Checked in 1, 2 and 3 CPU processes on the reference backend against a loop over every (source, token, rank),
including masks that send a token to a rank holding none of its experts (the mask, not the ids, decides).
"""
import pytest
import torch

from tests.helpers import bruteforce as bf
from tests.helpers.multiproc import run_ranks

HIDDEN, PER_RANK = 128, 4
SLOTS = 3  # fewer than the experts of one rank, so a single rank works too


def _inputs(rank, world, tokens):
    gen = torch.Generator().manual_seed(100 + rank)
    E = PER_RANK * world
    idx = bf.make_topk(gen, tokens, SLOTS, E, p_empty=0.3)
    mask = torch.rand(tokens, world, generator=gen) < 0.5      # independent of idx on purpose
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    w = torch.rand(tokens, SLOTS, generator=gen)
    per_expert = torch.randint(0, 9, (E,), generator=gen, dtype=torch.int32)
    return x, idx, w, mask, per_expert


def _expected(dst, world, all_inputs, alignment):
    E = PER_RANK * world
    rows, xs, ids, ws = [], [], [], []
    for s, (x, idx, w, mask, _) in enumerate(all_inputs):
        for t in range(x.shape[0]):
            if mask[t, dst]:
                rows.append((s, t))
                xs.append(x[t])
                li = [e - dst * PER_RANK if e >= 0 and e // PER_RANK == dst else -1 for e in idx[t].tolist()]
                ids.append(li)
                ws.append([wv if l >= 0 else 0.0 for wv, l in zip(w[t].tolist(), li)])
    recv_x = torch.stack(xs) if xs else torch.zeros(0, HIDDEN, dtype=torch.bfloat16)
    recv_idx = torch.tensor(ids, dtype=torch.int64).reshape(-1, SLOTS)
    recv_w = torch.tensor(ws, dtype=torch.float32).reshape(-1, SLOTS)
    counts = [sum(int(inp[4][dst * PER_RANK + e]) for inp in all_inputs) for e in range(PER_RANK)]
    counts = [(c + alignment - 1) // alignment * alignment for c in counts]
    id_counts = [sum(1 for li in ids if e in li) for e in range(PER_RANK)]
    return rows, recv_x, recv_idx, recv_w, counts, id_counts


def _worker(rank, world):
    import deepcomm
    E = PER_RANK * world
    tokens = [7, 0, 5][:world] if world > 1 else [6]
    all_inputs = [_inputs(r, world, tokens[r]) for r in range(world)]
    x, idx, w, mask, per_expert = all_inputs[rank]
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=HIDDEN, backend="reference")
    rows, want_x, want_idx, want_w, want_counts, want_id_counts = _expected(rank, world, all_inputs, 2)

    # mask only: rows, no ids/weights, counts from num_tokens_per_expert
    recv_x, recv_idx, recv_w, counts, handle = buf.dispatch(x, is_token_in_rank=mask, num_experts=E,
                                                            num_tokens_per_expert=per_expert, expert_alignment=2)
    assert torch.equal(recv_x, want_x) and recv_idx is None and recv_w is None
    assert counts == want_counts
    assert handle.recv_src_idx.tolist() == [t for _, t in rows]
    assert torch.equal(handle.is_token_in_rank, mask)

    # ids and weights travel; counts from the ids without num_tokens_per_expert
    recv_x2, recv_idx2, recv_w2, counts2, handle2 = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                                                 is_token_in_rank=mask)
    assert torch.equal(recv_x2, want_x) and torch.equal(recv_idx2, want_idx) and torch.equal(recv_w2, want_w)
    assert counts2 == want_id_counts

    # weights alone arrive as sent
    _, none_idx, raw_w, none_counts, _ = buf.dispatch(x, topk_weights=w, is_token_in_rank=mask)
    assert none_idx is None and none_counts is None
    want_raw = torch.stack([all_inputs[s][2][t] for s, t in rows]) if rows else torch.zeros(0, SLOTS)
    assert torch.equal(raw_w, want_raw)

    # FP8 pair routed by the mask
    from deepcomm.fp8 import per_token_cast_to_fp8
    pair = per_token_cast_to_fp8(x)
    got_pair = buf.dispatch(pair, is_token_in_rank=mask)[0]
    assert torch.equal(got_pair[0].view(torch.uint8), per_token_cast_to_fp8(want_x)[0].view(torch.uint8))

    # combine and cached dispatch reuse the handle: the sum of the copies, one per rank in the mask
    y = (recv_x.float() * (rank + 1)).to(torch.bfloat16)
    combined, _ = buf.combine(y, handle)
    sums = torch.zeros(x.shape[0], HIDDEN)
    for d in range(world):
        sums += mask[:, d:d + 1].float() * (x.float() * (d + 1)).to(torch.bfloat16).float()
    assert torch.equal(combined, sums.to(torch.bfloat16))
    cached = buf.dispatch(x * 2, handle=handle)
    assert torch.equal(cached[0], want_x * 2) and cached[3] == want_counts

    # bad input names the argument
    with pytest.raises(ValueError, match="^is_token_in_rank"):
        buf.dispatch(x, is_token_in_rank=mask.int())
    with pytest.raises(ValueError, match="^num_worst_tokens"):
        buf.dispatch(x, is_token_in_rank=mask, num_worst_tokens=32)
    with pytest.raises(ValueError, match="^is_token_in_rank"):
        buf.dispatch(x, handle=handle, is_token_in_rank=mask)
    buf.destroy()
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_route_only_dispatch_matches_bruteforce(world):
    assert run_ranks(_worker, world) == [True] * world


def test_pseudo_topk_packs_ranks_beyond_the_slots():
    from deepcomm.route_only import PSEUDO_SLOTS_MAX, pseudo_topk
    world = PSEUDO_SLOTS_MAX + 8
    mask = torch.zeros(3, world, dtype=torch.bool)
    mask[0, [1, 5, world - 1]] = True
    mask[2, :PSEUDO_SLOTS_MAX] = True
    got = pseudo_topk(mask, 4)
    assert got.shape == (3, PSEUDO_SLOTS_MAX)
    assert got[0, :3].tolist() == [4, 20, (world - 1) * 4] and (got[0, 3:] == -1).all()
    assert (got[1] == -1).all() and got[2].tolist() == [r * 4 for r in range(PSEUDO_SLOTS_MAX)]
    mask[1, :] = True
    with pytest.raises(ValueError, match="^is_token_in_rank"):
        pseudo_topk(mask, 4)
