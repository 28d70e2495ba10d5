"""NVSHMEM loading, off the GPU (the DEEPCOMM_LL_MEMORY setting: tests/api/test_config_choices.py): where the host
library is looked for, the errors when it or the extension's NVSHMEM support is missing, and (where NVSHMEM_HOME or the
nvidia-nvshmem wheel provides it) loading the real library and making a unique id, which needs no GPU.
Loading is per process, so those cases run in a fresh interpreter."""
import os
import subprocess
import sys
import textwrap

import pytest

from deepcomm.cuda import nvshmem_library as nl

from tests.helpers.paths import ROOT


def _extension_has_nvshmem() -> bool:
    from deepcomm._ext import load_extension
    C = load_extension()
    return C is not None and hasattr(C, "nvshmem")


def _python(code: str, **env):
    full = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=full, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)


def test_library_candidates_in_order(tmp_path, monkeypatch):
    home, wheel, empty = tmp_path / "home", tmp_path / "wheel", tmp_path / "empty"
    for d in (home / "lib", wheel / "lib", empty / "lib"):
        d.mkdir(parents=True)
    (home / "lib" / nl.LIB_NAME).write_bytes(b"")
    (wheel / "lib" / nl.LIB_NAME).write_bytes(b"")
    monkeypatch.setenv("NVSHMEM_HOME", str(home))
    monkeypatch.setattr(nl, "package_lib_dirs", lambda: [str(empty / "lib"), str(wheel / "lib")])
    assert nl.library_candidates() == [str(home / "lib" / nl.LIB_NAME), str(wheel / "lib" / nl.LIB_NAME), nl.LIB_NAME]
    monkeypatch.delenv("NVSHMEM_HOME")
    monkeypatch.setattr(nl, "package_lib_dirs", lambda: [])
    assert nl.library_candidates() == [nl.LIB_NAME]


def test_missing_extension_support_is_named(monkeypatch):
    class BuiltWithoutHeaders:
        NVSHMEM_MISSING = "deepcomm._C was built without NVSHMEM support: the NVSHMEM headers were not found"

    monkeypatch.setattr(nl, "load_extension", lambda: BuiltWithoutHeaders())
    with pytest.raises(nl.NvshmemUnavailableError, match="built without NVSHMEM support"):
        nl.load_library()
    monkeypatch.setattr(nl, "load_extension", lambda: None)
    monkeypatch.setattr(nl, "extension_error", lambda: "ModuleNotFoundError: No module named 'deepcomm._C'")
    with pytest.raises(nl.NvshmemUnavailableError, match="needs the extension deepcomm._C"):
        nl.load_library()


@pytest.mark.skipif(not _extension_has_nvshmem(), reason="deepcomm._C built without the NVSHMEM headers")
def test_missing_library_names_every_place_tried(tmp_path):
    p = _python("""
        from deepcomm.cuda import nvshmem_library as nl
        if "libnvshmem_host" in open("/proc/self/maps").read():
            print("PRELOADED")  # torch's own NVSHMEM support loaded it: the bare name would find it
        nl.package_lib_dirs = lambda: []
        try:
            print("LOADED", nl.load_library().loaded_path())
        except nl.NvshmemUnavailableError as exc:
            print(exc)
        """, NVSHMEM_HOME=str(tmp_path), LD_LIBRARY_PATH=str(tmp_path))
    if "LOADED" in p.stdout:  # also PRELOADED
        pytest.skip("libnvshmem_host.so.3 is reachable here by its bare name (already loaded by torch, or installed "
                    "system-wide): nothing is missing to report")
    assert "NVSHMEM not found" in p.stdout, p.stdout
    assert "libnvshmem_host.so.3: cannot open shared object file" in p.stdout, p.stdout
    assert "pip install nvidia-nvshmem-cu13" in p.stdout and "DEEPCOMM_LL_MEMORY=ipc" in p.stdout, p.stdout


@pytest.mark.skipif(not _extension_has_nvshmem(), reason="deepcomm._C built without the NVSHMEM headers")
@pytest.mark.skipif(nl.library_candidates() == [nl.LIB_NAME],
                    reason="no NVSHMEM here (set NVSHMEM_HOME or pip install nvidia-nvshmem-cu13)")
def test_real_library_loads_and_makes_a_unique_id():
    p = _python("""
        import os
        from deepcomm.cuda import nvshmem_library as nl
        n = nl.load_library()
        print("path", n.loaded_path())
        print("plugin", os.environ["NVSHMEM_BOOTSTRAP_UID_PLUGIN"])
        print("versions", n.library_version(), n.header_version())
        print("status", n.init_status())
        print("uid", len(n.get_unique_id()), n.unique_id_bytes())
        try:
            n.my_pe()
        except RuntimeError as exc:
            print("before init:", exc)
        """)
    out = p.stdout
    assert p.returncode == 0, out
    lib_dir = os.path.dirname(nl.library_candidates()[0])
    assert f"path {lib_dir}/libnvshmem_host.so.3" in out, out
    assert f"plugin {lib_dir}/nvshmem_bootstrap_uid.so.3" in out, out
    assert "versions (3, " in out and "status 0" in out and "uid 128 128" in out, out
    assert "before init: deepcomm: my_pe: NVSHMEM is not initialized in this process" in out, out
