"""``deep_ep.Buffer.runtime`` (also ``deep_ep_cpp.Buffer``): DeepEP's C++ runtime object, as its users call it.

Every method of DeepEP V1's pybind ``Buffer`` (csrc/deep_ep.cpp) is here:
- queries answered from deepcomm's topology: ``is_available``, ``is_internode_available``, ``get_num_rdma_ranks``,
  ``get_rdma_rank``, ``get_root_rdma_rank``, ``get_local_device_id``, ``get_comm_stream``,
  ``get_local_buffer_tensor(dtype, offset, use_rdma_buffer)`` (deep_ep.Buffer.get_local_buffer_tensor's region);
- calls with the same arguments as deep_ep.Buffer's: ``clean_low_latency_buffer``, the shrink calls,
  ``get_next_low_latency_combine_buffer(M, hidden, num_experts)``, ``destroy``;
- ``sync``: DeepEP's second construction step, which deepcomm did when the Buffer was made: it checks its
  arguments and returns;
- ``get_local_ipc_handle`` / ``get_local_nvshmem_unique_id`` (the bytes DeepEP's constructor exchanges to map its
  own buffers) and the raw entry points ``intranode_dispatch`` ... ``internode_combine``: RuntimeError saying why.
Names DeepEP's runtime shares with deepcomm's Buffer (``get_dispatch_layout``, ``low_latency_dispatch``,
``low_latency_combine``) and every other attribute are the ``deepcomm.Buffer`` underneath, so ``buffer.runtime``
is also deepcomm's API. ``deep_ep_cpp.Buffer(...)`` itself cannot be made: deepcomm's runtime is built by
``deep_ep.Buffer(group, ...)``.
"""
from __future__ import annotations

from typing import Optional

import torch

_RAW_ENTRY_POINTS = ("intranode_dispatch", "intranode_combine", "internode_dispatch", "internode_combine")


class Runtime:
    """DeepEP's runtime calls over a deep_ep.Buffer (``_shim``); other attributes are its current deepcomm.Buffer."""

    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError("deep_ep_cpp.Buffer: deepcomm's runtime is made by deep_ep.Buffer(group, num_nvl_bytes, "
                           "num_rdma_bytes, ...), which connects the ranks itself; use that Buffer and its .runtime")

    @classmethod
    def _over(cls, shim) -> "Runtime":
        runtime = object.__new__(cls)
        runtime.__dict__["_shim"] = shim
        return runtime

    @property
    def deepcomm(self):
        """The deepcomm.Buffer new calls run on."""
        return self._shim.buffer

    def _topology(self):
        return self.deepcomm.topology

    # ---- queries ----
    def is_available(self) -> bool:
        return self.deepcomm._backend is not None  # False after destroy()

    def is_internode_available(self) -> bool:
        return self.is_available() and self._topology().num_nodes > 1

    def get_num_rdma_ranks(self) -> int:
        return self._topology().num_nodes

    def get_rdma_rank(self) -> int:
        return self.deepcomm.rank // self._topology().gpus_per_node

    def get_root_rdma_rank(self, global_: bool) -> int:
        """DeepEP's: the rank on this node (``global_``), else 0."""
        return self.deepcomm.rank % self._topology().gpus_per_node if global_ else 0

    def get_local_device_id(self) -> int:
        """The CUDA device index of this Buffer; -1 for a Buffer on the CPU (reference backend)."""
        device = self.deepcomm.device
        if device.type != "cuda":
            return -1
        return device.index if device.index is not None else torch.cuda.current_device()

    def get_comm_stream(self):
        return self._shim.get_comm_stream()

    def get_local_buffer_tensor(self, dtype: torch.dtype, offset: int = 0, use_rdma_buffer: bool = False):
        """DeepEP's runtime form: the whole region from byte ``offset`` (deep_ep.Buffer.get_local_buffer_tensor)."""
        return self._shim.get_local_buffer_tensor(dtype, None, offset, use_rdma_buffer)

    # ---- construction steps DeepEP's constructor makes ----
    def get_local_ipc_handle(self):
        raise RuntimeError("get_local_ipc_handle: deepcomm exchanged its own CUDA IPC handles (or NVSHMEM heap) when "
                           "the Buffer was made; there are no DeepEP buffers to map, and sync() needs none")

    def get_local_nvshmem_unique_id(self):
        raise RuntimeError("get_local_nvshmem_unique_id: deepcomm bootstraps NVSHMEM itself, over the group, when a "
                           "Buffer needs it; sync() needs no unique id")

    def sync(self, device_ids, all_gathered_handles, root_unique_id_opt: Optional[bytes] = None) -> None:
        """Nothing left to do: the ranks were connected when the Buffer was made. Checks DeepEP's argument shapes."""
        world = self.deepcomm.world_size
        for name, value in (("device_ids", device_ids), ("all_gathered_handles", all_gathered_handles)):
            if not isinstance(value, (list, tuple)) or len(value) not in (0, world):
                raise ValueError(f"{name}: expected a list of {world} entries (one per rank), got {value!r:.80}")
        if not self.is_available():
            raise RuntimeError("sync: this Buffer was destroyed")

    def destroy(self) -> None:
        self._shim.destroy()

    # ---- calls with deep_ep.Buffer's arguments ----
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        self._shim.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool) -> None:
        self._shim.low_latency_update_mask_buffer(rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        self._shim.low_latency_query_mask_buffer(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        self._shim.low_latency_clean_mask_buffer()

    def get_next_low_latency_combine_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                            num_experts: int) -> torch.Tensor:
        """The bf16 ``[E / R, R * M, hidden]`` tensor deep_ep.Buffer.get_next_low_latency_combine_buffer returns for
        a handle of this shape."""
        world = self.deepcomm.world_size
        for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                            ("hidden", hidden), ("num_experts", num_experts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if num_experts % world:
            raise ValueError(f"num_experts: expected a multiple of the {world} ranks, got {num_experts}")
        return self._shim._combine_buffer((num_experts // world, world * num_max_dispatch_tokens_per_rank, hidden))

    def __getattr__(self, name: str):
        if name in _RAW_ENTRY_POINTS:
            raise RuntimeError(f"{name}: DeepEP's raw C++ entry point (its internal argument list) has no deepcomm "
                               f"counterpart; deep_ep.Buffer.dispatch / combine (internode_dispatch / "
                               f"internode_combine) take DeepEP's Python arguments")
        try:
            return getattr(self.deepcomm, name)
        except AttributeError:
            raise AttributeError(f"deep_ep.Buffer.runtime (deepcomm's shim) has no {name!r}: it answers DeepEP's "
                                 f"runtime calls and is otherwise the deepcomm.Buffer") from None

    def __repr__(self) -> str:
        return f"deep_ep runtime over {self.deepcomm!r}"
