"""Small host-built tables (lists of ints) handed to the internode kernels, copied to the device without a host
sync: through pinned memory with a non-blocking copy on the current stream. A plain ``torch.tensor(...).to(cuda)``
copies from pageable memory and then synchronizes the stream, which would put a host wait into every call. The
caching host allocator keeps the pinned block until the copy has run, so the table may be dropped at once."""
from __future__ import annotations

import torch


def device_table(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, queued on its current stream (no host sync on CUDA)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A pinned host tensor that receives ``t`` (a CUDA tensor) by a non-blocking copy on the current stream:
    valid once that stream has passed this point (an event or a stream synchronize). A CPU ``t`` is cloned."""
    if t.device.type != "cuda":
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out
