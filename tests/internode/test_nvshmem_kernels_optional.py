"""deepcomm._nvshmem_kernels is optional: deepcomm imports without it, and asking for internode_transport="nvshmem"
without it raises NvshmemUnavailableError naming the module and how to get it (CPU, in CI)."""
import subprocess
import sys

import pytest

from deepcomm.internode import nvshmem_kernels
from deepcomm.cuda.nvshmem_library import NvshmemUnavailableError


def test_import_deepcomm_never_loads_the_device_module():
    code = "import sys, deepcomm, deepcomm.internode.backend; print('deepcomm._nvshmem_kernels' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_missing_module_names_the_reason(monkeypatch):
    monkeypatch.setattr(nvshmem_kernels, "load_library", lambda: object())
    monkeypatch.setattr(nvshmem_kernels, "_load", lambda name: (None, "ImportError: No module named " + name))
    reason = nvshmem_kernels.unavailable_reason()
    assert "deepcomm._nvshmem_kernels is not available" in reason and "libnvshmem_device.a" in reason
    assert "nvshmem-host" in reason
    with pytest.raises(NvshmemUnavailableError, match="internode_transport='nvshmem'.*_nvshmem_kernels"):
        nvshmem_kernels.load_device_kernels()


def test_missing_host_library_is_the_reason(monkeypatch):
    def missing():
        raise NvshmemUnavailableError("NVSHMEM not found: no libnvshmem_host.so.3\nTo fix: install")
    monkeypatch.setattr(nvshmem_kernels, "load_library", missing)
    assert nvshmem_kernels.unavailable_reason() == "NVSHMEM not found: no libnvshmem_host.so.3"


def test_backend_choice_asks_for_the_device_module(monkeypatch):
    from deepcomm import backends
    from deepcomm.cuda import nvshmem_library
    monkeypatch.setattr(nvshmem_library, "load_library", lambda: object())
    monkeypatch.setattr(nvshmem_kernels, "unavailable_reason", lambda: "deepcomm._nvshmem_kernels is not available")
    assert backends.nvshmem_unavailable_reason("nvshmem") == "deepcomm._nvshmem_kernels is not available"
    assert backends.nvshmem_unavailable_reason("nvshmem-host") is None
