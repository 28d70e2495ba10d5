"""Which ranks share a node: ``R = num_nodes x gpus_per_node``, rank ``r`` is GPU ``r % G`` of node ``r // G``.

Inside a node GPUs talk over NVLink; between nodes only GPUs with the same local index talk, over RDMA
(docs/internode.md). The number of GPUs per node comes from, in this order:

1. the ``gpus_per_node`` argument (``Buffer(gpus_per_node=...)``);
2. the environment variable ``DEEPCOMM_GPUS_PER_NODE``, which also lets one host pose as several nodes
   (2 GPUs with ``DEEPCOMM_GPUS_PER_NODE=1`` are 2 nodes x 1 GPU);
3. ``LOCAL_WORLD_SIZE``, set by torchrun (and by deepcomm's mpirun launcher); a group no larger than it is
   taken to lie on one node;
4. otherwise every rank is on one node.

Ranks of a group must be numbered node by node (as torchrun and mpirun's by-slot mapping number them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Mapping, Optional

ENV_GPUS_PER_NODE = "DEEPCOMM_GPUS_PER_NODE"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"


@dataclass(frozen=True)
class Topology:
    num_nodes: int
    gpus_per_node: int

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def is_internode(self) -> bool:
        return self.num_nodes > 1

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.gpus_per_node

    def local_index(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.gpus_per_node

    def rank_of(self, node: int, local_index: int) -> int:
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node: expected in [0, {self.num_nodes}), got {node}")
        if not 0 <= local_index < self.gpus_per_node:
            raise ValueError(f"local_index: expected in [0, {self.gpus_per_node}), got {local_index}")
        return node * self.gpus_per_node + local_index

    def node_ranks(self, node: int) -> List[int]:
        """The ranks of ``node``, ascending."""
        return [self.rank_of(node, g) for g in range(self.gpus_per_node)]

    def rail_peers(self, rank: int) -> List[int]:
        """The ranks with ``rank``'s local index on every node (``rank`` included), ascending: its RDMA peers."""
        return [self.rank_of(n, self.local_index(rank)) for n in range(self.num_nodes)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank: expected in [0, {self.world_size}), got {rank}")


def _parse_env(name: str, value: str) -> int:
    try:
        n = int(value.strip())
    except ValueError:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}") from None
    if n < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    return n


def resolve_topology(world_size: int, gpus_per_node: Optional[int] = None,
                     environ: Optional[Mapping[str, str]] = None) -> Topology:
    """The topology of a group of ``world_size`` ranks (sources in the order of the module docstring).
    ``ValueError`` names the argument or environment variable when it is not a positive divisor of world_size."""
    env = os.environ if environ is None else environ
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if gpus_per_node is not None:
        source = "gpus_per_node"
        if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
            raise ValueError(f"gpus_per_node: expected a positive int, got {gpus_per_node!r}")
        g = gpus_per_node
    elif env.get(ENV_GPUS_PER_NODE, "").strip():
        source = ENV_GPUS_PER_NODE
        g = _parse_env(source, env[ENV_GPUS_PER_NODE])
    elif env.get(ENV_LOCAL_WORLD_SIZE, "").strip():
        source = ENV_LOCAL_WORLD_SIZE
        g = min(_parse_env(source, env[ENV_LOCAL_WORLD_SIZE]), world_size)  # a subgroup inside one node
    else:
        return Topology(1, world_size)
    if world_size % g != 0:
        raise ValueError(f"{source}: {g} GPUs per node does not divide the {world_size} ranks of the group")
    return Topology(world_size // g, g)
