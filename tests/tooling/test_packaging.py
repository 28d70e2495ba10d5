"""Package metadata: one version (deepcomm/_version.py) in the import and in the built wheel, which carries
py.typed and the LICENSE. Built Python-only (DEEPCOMM_NO_CUDA=1) from a copy of the sources."""
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

import deepcomm

from tests.helpers.paths import ROOT


def test_version_and_license_files():
    assert deepcomm.__version__ == deepcomm._version.__version__
    assert all(part.isdigit() for part in deepcomm.__version__.split("."))
    assert os.path.exists(os.path.join(ROOT, "deepcomm", "py.typed"))
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert text.startswith("MIT License") and "Copyright (c) 2026 the deepcomm authors" in text


def test_wheel_metadata(tmp_path):
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    shutil.copytree(os.path.join(ROOT, "deepcomm"), src / "deepcomm",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    env = dict(os.environ, DEEPCOMM_NO_CUDA="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q",
                          "-w", str(tmp_path / "dist"), str(src)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / "dist").glob("deepcomm-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        fields = z.read(meta).decode()
    assert "deepcomm/py.typed" in names
    assert any(n.endswith("LICENSE") and ".dist-info/" in n for n in names), names
    assert f"\nVersion: {deepcomm.__version__}\n" in fields
    assert "License-Expression: MIT" in fields
