"""Loading of ``deepcomm._nvshmem_kernels``, the hierarchical kernels whose RDMA hop is NVSHMEM device puts
(csrc/kernels/hier_nvshmem_poster.cuh), for ``internode_transport="nvshmem"``. The module is optional: it is
built only where NVSHMEM's device library was found at build time (setup.py), and needs NVSHMEM's host library
at run time. Its absence is a normal state: ``import deepcomm`` never loads it, and asking for the transport
without it raises NvshmemUnavailableError saying why."""
from __future__ import annotations

from types import ModuleType

from .._ext import _load
from ..cuda.nvshmem_library import NvshmemUnavailableError, load_library

MODULE = "deepcomm._nvshmem_kernels"
BUILD_HINT = ("install the NVSHMEM wheel (pip install nvidia-nvshmem-cu13) before building deepcomm, so that "
              "setup.py finds lib/libnvshmem_device.a and builds deepcomm._nvshmem_kernels; or choose "
              "internode_transport='nvshmem-host' (NVSHMEM's host API, torch routing) or 'emulated'")


def unavailable_reason() -> str | None:
    """``None`` when the module imports (after NVSHMEM's host library is opened), else why not."""
    try:
        load_library()  # the host library first: the module's NEEDED entry then resolves to this same instance
    except NvshmemUnavailableError as exc:
        return str(exc).splitlines()[0]
    module, why = _load(MODULE)
    if module is None:
        return f"{MODULE} is not available ({why}); {BUILD_HINT}"
    return None


def load_device_kernels() -> ModuleType:
    """``deepcomm._nvshmem_kernels``, or NvshmemUnavailableError naming the reason. Does not register the device
    state: ``init_device_state()`` needs NVSHMEM initialized (after the transport's symmetric allocation)."""
    reason = unavailable_reason()
    if reason is not None:
        raise NvshmemUnavailableError(f"internode_transport='nvshmem' (NVSHMEM device puts) cannot run: {reason}")
    return _load(MODULE)[0]
