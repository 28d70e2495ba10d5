"""Host-side pieces of the internode kernels' launcher (deepcomm/internode/hier_kernels.py) that need no GPU: how
num_sms is split between the RDMA and NVLink roles, and the per-(token, node) rows of the send sections. The
kernels themselves run in tests/internode/test_internode.py."""
from __future__ import annotations

import torch

from deepcomm.internode.hier_kernels import _rdma_slots
from deepcomm.internode.sm_split import nic_blocks_for, split_sms


def test_split_sms_halves_and_leaves_room_for_poster_and_nics():
    assert split_sms(24, 132, 2) == (12, 12)
    assert split_sms(7, 132, 2) == (3, 4)
    assert split_sms(1, 132, 2) == (1, 1)          # each role gets a block however small num_sms is
    assert sum(split_sms(132, 132, 2)) == 130       # poster + one NIC block must stay resident beside them
    assert sum(split_sms(132, 132, 31)) == 101      # 32 nodes: 31 NIC blocks
    assert split_sms(8, 3, 2) == (1, 1)             # a device too small for the grid: the launcher refuses it


def test_nic_blocks_share_the_sms_left_and_stay_in_range():
    assert nic_blocks_for(132 - 24 - 1, 1, 8) == 8   # 2 nodes, default num_sms: the most blocks per queue
    assert nic_blocks_for(132 - 24 - 1, 31, 8) == 3  # 32 nodes: 107 SMs shared by 31 queues
    assert nic_blocks_for(1, 1, 8) == 1              # num_sms took every SM but one NIC block per queue
    assert nic_blocks_for(0, 3, 8) == 1              # never below one (the launcher refuses a grid too large)
    for free in range(0, 140):
        for peers in (1, 2, 7, 31):
            n = nic_blocks_for(free, peers, 8)
            assert 1 <= n <= 8 and (n == 1 or peers * n <= free)


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
