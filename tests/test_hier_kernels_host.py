"""Host-side pieces of the internode kernels' launcher (deepcomm/cuda/hier_kernels.py) that need no GPU: how
num_sms is split between the RDMA and NVLink roles, and the per-(token, node) rows of the send sections. The
kernels themselves run in tests/gpu/test_internode.py."""
from __future__ import annotations

import torch

from deepcomm.cuda.hier_kernels import _rdma_slots, split_sms


def test_split_sms_halves_and_leaves_room_for_poster_and_nics():
    assert split_sms(24, 132, 2) == (12, 12)
    assert split_sms(7, 132, 2) == (3, 4)
    assert split_sms(1, 132, 2) == (1, 1)          # each role gets a block however small num_sms is
    assert sum(split_sms(132, 132, 2)) == 130       # poster + one NIC block must stay resident beside them
    assert sum(split_sms(132, 132, 31)) == 101      # 32 nodes: 31 NIC blocks
    assert split_sms(8, 3, 2) == (1, 1)             # a device too small for the grid: the launcher refuses it


def test_rdma_slots_number_each_nodes_tokens_in_order():
    in_node = torch.tensor([[True, False, True],
                            [False, False, True],
                            [True, False, False],
                            [True, False, True]])
    want = torch.tensor([[0, -1, 0],
                         [-1, -1, 1],
                         [1, -1, -1],
                         [2, -1, 2]], dtype=torch.int32)
    got = _rdma_slots(in_node)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert _rdma_slots(torch.zeros(0, 4, dtype=torch.bool)).shape == (0, 4)
