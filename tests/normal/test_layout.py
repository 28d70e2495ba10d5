"""Layout math against brute-force loops."""
import pytest
import torch

from tests.helpers import bruteforce as bf
from deepcomm import layout


@pytest.mark.parametrize("world,experts,tokens,slots", [(1, 4, 5, 2), (2, 8, 17, 3), (3, 9, 1, 4), (4, 32, 40, 8),
                                                      (4, 8, 0, 2)])
def test_layout_matches_loops(world, experts, tokens, slots):
    gen = torch.Generator().manual_seed(world * 100 + tokens)
    idx = bf.make_topk(gen, tokens, slots, experts, p_empty=0.3)
    per_rank, per_expert, in_rank = layout.get_dispatch_layout(idx, experts, world)
    want_rank, want_expert, want_in_rank, want_pos = bf.layout(idx, experts, world)
    assert per_rank.dtype == torch.int32 and per_expert.dtype == torch.int32 and in_rank.dtype == torch.bool
    assert torch.equal(per_rank, want_rank)
    assert torch.equal(per_expert, want_expert)
    assert torch.equal(in_rank, want_in_rank)
    assert torch.equal(layout.send_positions(in_rank), want_pos)
    fused_in_rank, fused_per_expert = layout.route_and_expert_counts(idx, experts, world)  # the backends' form
    assert fused_in_rank.dtype == torch.bool and fused_per_expert.dtype == torch.int32
    assert torch.equal(fused_in_rank, want_in_rank) and torch.equal(fused_per_expert, want_expert)


def test_token_counts_once_per_rank_and_minus_one_nowhere():
    idx = torch.tensor([[0, 1, -1], [-1, -1, -1], [3, 2, 0]])
    per_rank, per_expert, in_rank = layout.get_dispatch_layout(idx, 4, 2)
    assert per_rank.tolist() == [2, 1]
    assert per_expert.tolist() == [2, 1, 1, 1]
    assert in_rank.tolist() == [[True, False], [False, False], [True, True]]
    assert layout.send_positions(in_rank).tolist() == [[0, -1], [-1, -1], [1, 0]]
    assert layout.send_order(in_rank).tolist() == [0, 2, 2]


def test_token_counts_once_per_expert_with_duplicate_slots():
    idx = torch.tensor([[1, 1, -1], [3, 1, 3]])
    _, per_expert, _ = layout.get_dispatch_layout(idx, 4, 2)
    assert per_expert.tolist() == [0, 2, 0, 1]


def test_local_experts_and_aligned_counts():
    idx = torch.tensor([[4, 5, 1], [7, -1, 5], [5, 5, 0]])
    local = layout.to_local_experts(idx, rank=1, experts_per_rank=4)
    assert local.tolist() == [[0, 1, -1], [3, -1, 1], [1, 1, -1]]
    assert layout.count_rows_per_local_expert(local, 4, 1) == [1, 3, 0, 1]
    assert layout.count_rows_per_local_expert(local, 4, 4) == [4, 4, 0, 4]
