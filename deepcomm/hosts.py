"""Host names of a process group's ranks (a collective), for the checks that need ranks on one host."""
from __future__ import annotations

import socket
from typing import List

import torch.distributed as dist


def hosts_of(group) -> List[str]:
    """Every rank's host name, by rank. Collective over ``group``."""
    names: List[str] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(names, socket.gethostname(), group=group)
    return names
