"""``deep_ep.Buffer.runtime``: DeepEP's C++ runtime object, as far as its users read it.

Users ask it what the Buffer spans (``get_num_rdma_ranks()`` to tell internode from intranode, ``get_rdma_rank()``,
``get_local_device_id()``, ``get_comm_stream()``, ``is_available()``). Here it answers those from deepcomm's
topology and forwards every other attribute to the ``deepcomm.Buffer`` underneath, so ``buffer.runtime`` is also
deepcomm's API. DeepEP's low-level entry points (``intranode_dispatch``, ``sync``, ``get_local_ipc_handle`` ...)
are not there: asking for one raises ``AttributeError`` naming it.
"""
from __future__ import annotations

import torch

from ...buffer import Buffer as DeepcommBuffer


class Runtime:
    """DeepEP's runtime queries over a ``deepcomm.Buffer`` (``deepcomm``); other attributes are the Buffer's."""

    def __init__(self, deepcomm: DeepcommBuffer, comm_stream) -> None:
        self.deepcomm = deepcomm
        self._comm_stream = comm_stream  # () -> the stream DeepEP's get_comm_stream() names
        topo = deepcomm.topology
        self._gpus_per_node, self._num_nodes = topo.gpus_per_node, topo.num_nodes

    def is_available(self) -> bool:
        return self.deepcomm._backend is not None  # False after destroy()

    def is_internode_available(self) -> bool:
        return self.is_available() and self._num_nodes > 1

    def get_num_rdma_ranks(self) -> int:
        return self._num_nodes

    def get_rdma_rank(self) -> int:
        return self.deepcomm.rank // self._gpus_per_node

    def get_root_rdma_rank(self, global_: bool) -> int:
        """DeepEP's: the rank on this node (``global_``), else 0."""
        return self.deepcomm.rank % self._gpus_per_node if global_ else 0

    def get_local_device_id(self) -> int:
        """The CUDA device index of this Buffer; -1 for a Buffer on the CPU (reference backend)."""
        device = self.deepcomm.device
        if device.type != "cuda":
            return -1
        return device.index if device.index is not None else torch.cuda.current_device()

    def get_comm_stream(self):
        return self._comm_stream()

    def __getattr__(self, name: str):
        try:
            return getattr(self.deepcomm, name)
        except AttributeError:
            raise AttributeError(f"deep_ep.Buffer.runtime (deepcomm's shim) has no {name!r}: it answers DeepEP's "
                                 f"runtime queries and is otherwise the deepcomm.Buffer") from None

    def __repr__(self) -> str:
        return f"deep_ep runtime over {self.deepcomm!r}"
