"""How the hierarchical kernels' grid shares a GPU's SMs: the RDMA and NVLink roles, and the emulated NICs."""
from __future__ import annotations


def split_sms(num_sms: int, sm_count: int, extra_blocks: int) -> tuple:
    """(rdma_blocks, nvl_blocks): half of ``num_sms`` each, at least one, leaving room on a device of
    ``sm_count`` SMs for the ``extra_blocks`` (poster and NIC blocks) every block of the grid must be resident
    beside."""
    usable = max(2, min(num_sms, sm_count - extra_blocks))
    rdma = max(1, usable // 2)
    return rdma, max(1, usable - rdma)


def nic_blocks_for(free_sms: int, num_peers: int, most: int) -> int:
    """Blocks per queue pair's emulated NIC (its leader and helpers, csrc/transport/nic_serve_block.cuh): the
    ``free_sms`` SMs the rest of the grid leaves, shared evenly by the ``num_peers`` queues, in [1, most]. One
    block copies ~15-20 GB/s over NVLink; a large write is split among them."""
    return max(1, min(most, free_sms // max(1, num_peers)))
