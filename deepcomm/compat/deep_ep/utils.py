"""``deep_ep.utils``: ``EventHandle``, ``EventOverlap`` and ``check_nvlink_connections``, as in DeepEP V1."""
from __future__ import annotations

import os
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from ._cpp import EventHandle


class EventOverlap:
    """DeepEP's event wrapper: ``current_stream_wait()``, and ``with event: ...`` waits on exit.
    ``extra_tensors`` keeps tensors alive until the wrapper dies (DeepEP's graph-friendly ``record_stream``)."""

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Tuple[torch.Tensor]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """The current stream waits for the event. Like DeepEP's (an assert there), it needs an event: calls
        made with ``async_finish=False`` return none."""
        if self.event is None:
            raise RuntimeError("EventOverlap.current_stream_wait: no event (the call was made with async_finish=False)")
        self.event.current_stream_wait()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


def check_nvlink_connections(group: dist.ProcessGroup):
    """DeepEP's check: PCIe GPUs (pairwise NVLink at best) take at most 2 ranks, each pair linked by NVLink.
    Nothing to check without a GPU."""
    if group is None or not torch.cuda.is_available() or 'PCIE' not in torch.cuda.get_device_name():
        return
    if group.size() > 2:
        raise ValueError(f"group: PCIe GPUs only have pairwise NVLink connections, got {group.size()} ranks")
    import pynvml  # as DeepEP: only needed on PCIe GPUs
    pynvml.nvmlInit()
    try:
        devices = os.environ.get('CUDA_VISIBLE_DEVICES', '0,1,2,3,4,5,6,7').strip(',').split(',')
        physical = [0] * group.size()
        dist.all_gather_object(physical, int(devices[torch.cuda.current_device()]), group)
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in physical]
        for i, handle in enumerate(handles):
            for j, peer in enumerate(handles):
                if i < j and pynvml.nvmlDeviceGetP2PStatus(handle, peer, pynvml.NVML_P2P_CAPS_INDEX_NVLINK) \
                        != pynvml.NVML_P2P_STATUS_OK:
                    raise ValueError(f"group: GPU {physical[i]} and GPU {physical[j]} are not connected via NVLink")
    finally:
        pynvml.nvmlShutdown()


__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]
