"""Finding and opening NVSHMEM's host library for ``deepcomm._C.nvshmem`` (csrc/transport/nvshmem_host.hpp), and
the error that says what is missing when it cannot be."""
from __future__ import annotations

import importlib.util
import os
from typing import List

from .._ext import extension_error, load_extension

LIB_NAME = "libnvshmem_host.so.3"
UID_PLUGIN = "nvshmem_bootstrap_uid.so.3"
INSTALL_HINT = ("install the NVSHMEM wheel matching your CUDA major version into this Python environment "
                "(pip install nvidia-nvshmem-cu13, or -cu12), or set NVSHMEM_HOME to an NVSHMEM 3.x install; "
                "or use DEEPCOMM_LL_MEMORY=ipc")


class NvshmemUnavailableError(RuntimeError):
    """NVSHMEM was selected but cannot be loaded or initialized here; the message says what is missing."""


def package_lib_dirs() -> List[str]:
    """``lib/`` of the nvidia-nvshmem wheel (the Python package ``nvidia.nvshmem``), when installed."""
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    return [os.path.join(d, "lib") for d in (spec.submodule_search_locations or [])]


def library_candidates() -> List[str]:
    """Where the host library is looked for, in order: ``$NVSHMEM_HOME/lib``, the wheel's ``lib/``, then the bare
    name (the dynamic loader's search: ``LD_LIBRARY_PATH``, the ldconfig cache)."""
    dirs = []
    if os.environ.get("NVSHMEM_HOME"):
        dirs.append(os.path.join(os.environ["NVSHMEM_HOME"], "lib"))
    dirs += package_lib_dirs()
    return [os.path.join(d, LIB_NAME) for d in dirs if os.path.exists(os.path.join(d, LIB_NAME))] + [LIB_NAME]


def extension_nvshmem():
    """``deepcomm._C.nvshmem``, or NvshmemUnavailableError saying why it is not there."""
    C = load_extension()
    if C is None:
        raise NvshmemUnavailableError(f"NVSHMEM needs the extension deepcomm._C, which is not available "
                                      f"({extension_error()})")
    module = getattr(C, "nvshmem", None)
    if module is None:
        raise NvshmemUnavailableError(getattr(C, "NVSHMEM_MISSING", "deepcomm._C has no NVSHMEM support"))
    return module


def load_library():
    """Open NVSHMEM's host library (once per process) and return ``deepcomm._C.nvshmem``. Also points NVSHMEM at
    the unique-id bootstrap plugin next to the library (``NVSHMEM_BOOTSTRAP_UID_PLUGIN``, unless already set), so
    a plugin of another NVSHMEM on ``LD_LIBRARY_PATH`` is never picked up."""
    n = extension_nvshmem()
    if n.loaded():
        return n
    try:
        path = n.load(library_candidates())
    except RuntimeError as exc:
        raise NvshmemUnavailableError(f"NVSHMEM not found: {exc}\nTo fix: {INSTALL_HINT}") from None
    plugin = os.path.join(os.path.dirname(path), UID_PLUGIN)
    if os.path.dirname(path) and os.path.exists(plugin):
        os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_PLUGIN", plugin)
    return n
