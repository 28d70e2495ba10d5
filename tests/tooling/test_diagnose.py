"""`python -m deepcomm`: the diagnosis runs anywhere and says what each backend would do; its parts read the
build, the GPUs and NVSHMEM from stand-ins where this machine has none."""
import json
import os
import subprocess
import sys
import types

import pytest

import deepcomm
from deepcomm import diagnose

from tests.helpers.paths import ROOT


def _run(*code_or_args, env=None):
    env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([sys.executable, *code_or_args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_python_m_deepcomm_on_this_machine():
    out = _run("-m", "deepcomm", env={"DEEPCOMM_LOG": "info"})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith(f"deepcomm {deepcomm.__version__} ")
    for part in ("torch ", "GPUs: ", "  reference: available", "  cuda: ", "  auto: ", "  emulated: ", "  nvshmem: ",
                 "  ipc: ", "  DEEPCOMM_LOG=info"):
        assert part in text, text
    assert _run("-m", "deepcomm", "--bogus").returncode == 2
    assert "usage: python -m deepcomm" in _run("-m", "deepcomm", "--help").stdout


def test_without_the_extension():
    out = _run("-c", "import sys; sys.modules['deepcomm._C'] = None\nfrom deepcomm.diagnose import main; main([])")
    assert out.returncode == 0, out.stderr
    assert "extension deepcomm._C: not available (" in out.stdout
    assert "  cuda: not here: the extension deepcomm._C is not available" in out.stdout


def test_build_info_from_the_file_or_the_link_line(tmp_path):
    lib = tmp_path / "_C.so"
    lib.write_bytes(b"\x7fELF junk -arch sm_90a -m 64 -l rt junk -arch sm_100 more")
    C = types.SimpleNamespace(__file__=str(lib))
    assert diagnose.build_info(C) == {"cuda_arch": "sm_100, sm_90a"}
    (tmp_path / "_build_info.json").write_text(json.dumps({"cuda_arch": "sm_90", "nvcc": "Build cuda_13.0"}))
    assert diagnose.build_info(C)["nvcc"] == "Build cuda_13.0"
    assert diagnose.build_info(None) == {}


def test_nvshmem_status(monkeypatch, tmp_path):
    assert diagnose.nvshmem_status(None)[0] is False
    without = types.SimpleNamespace(NVSHMEM_MISSING="built without NVSHMEM headers")
    assert diagnose.nvshmem_status(without) == (False, None, "built without NVSHMEM headers")
    lib = tmp_path / "lib" / "libnvshmem_host.so.3"
    lib.parent.mkdir()
    lib.write_bytes(b"")
    monkeypatch.setenv("NVSHMEM_HOME", str(tmp_path))
    with_it = types.SimpleNamespace(nvshmem=object())
    assert diagnose.nvshmem_status(with_it) == (True, str(lib), None)
    monkeypatch.setenv("NVSHMEM_HOME", str(tmp_path / "nowhere"))
    monkeypatch.setattr("deepcomm.cuda.nvshmem_library.package_lib_dirs", lambda: [])
    compiled, path, why = diagnose.nvshmem_status(with_it)
    assert (compiled, path) == (True, None) and "libnvshmem_host.so.3 not in" in why


def test_gpu_table_with_stand_in_gpus(monkeypatch):
    cuda = diagnose.torch.cuda
    props = types.SimpleNamespace(name="H200", major=9, minor=0, multi_processor_count=132, total_memory=141 << 30)
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: 3)
    monkeypatch.setattr(cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(cuda, "can_device_access_peer", lambda i, j: {i, j} != {0, 2})
    lines = diagnose.gpu_lines()
    assert lines[0] == "GPUs: 3" and lines[1] == "  cuda:0 H200, sm_90, 132 SMs, 141 GiB"
    assert lines[-3:] == ["      0    -   ok   no", "      1   ok    -   ok", "      2   no   ok    -"]


def test_report_says_how_plain_calls_are_read(monkeypatch):
    from deepcomm._ext import load_extension
    from deepcomm.cuda import arg_reader
    C = load_extension()
    if C is None:
        pytest.skip("deepcomm._C is not built")
    with_table = diagnose.exchange_table_line(C)
    assert ("read in C++" in with_table) == (arg_reader.exchange_api() is not None)
    monkeypatch.setattr(arg_reader, "exchange_api", lambda: None)
    assert "read by the Python checks" in diagnose.exchange_table_line(C)
