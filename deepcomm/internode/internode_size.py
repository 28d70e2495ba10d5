"""How large an internode topology the extension serves (csrc/runtime/internode_limits.hpp, exported as
``INTERNODE_MAX_RANKS`` / ``INTERNODE_MAX_NODES`` of ``deepcomm._C.transport``; never copied here)."""
from __future__ import annotations

from typing import Optional


def internode_size_problem(T, world_size: int, gpus_per_node: int) -> Optional[str]:
    """``None`` when ``world_size`` ranks of ``gpus_per_node`` per node fit every internode table of the extension
    module ``T`` (``deepcomm._C.transport``); otherwise the reason."""
    nodes = world_size // gpus_per_node
    if world_size > T.INTERNODE_MAX_RANKS:
        return f"the internode path takes at most {T.INTERNODE_MAX_RANKS} ranks, the group has {world_size}"
    if nodes > T.INTERNODE_MAX_NODES:
        return (f"the internode path takes at most {T.INTERNODE_MAX_NODES} nodes, the topology has {nodes} "
                f"({world_size} ranks, gpus_per_node={gpus_per_node})")
    if gpus_per_node > T.MAX_NODE_GPUS:
        return f"the NVLink hop takes at most {T.MAX_NODE_GPUS} GPUs per node, gpus_per_node is {gpus_per_node}"
    return None
