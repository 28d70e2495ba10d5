"""launch/setup.sh picks the Python that already imports torch, makes a venv only where none does, and never
installs torch where one is importable. Checked with fake interpreters: shell scripts that answer the
`import torch` probe as told, log every call, and hand anything else to the real interpreter."""
import os
import shutil
import stat
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT

SETUP = os.path.join(ROOT, "launch", "setup.sh")

_FAKE = """#!/bin/sh
echo "$*" >> {log}
case "$*" in
  "-c import torch") exit {torch_rc} ;;
  "-c import sys; print(sys.prefix)") echo {prefix}; exit 0 ;;
  "-m pip"*) exit 0 ;;
esac
exec {real} "$@"
"""


def _fake_env(prefix, torch, log, kind="venv"):
    """A fake environment at ``prefix``: bin/python and bin/python3 answering the torch probe with ``torch``."""
    bindir = prefix / "bin"
    bindir.mkdir(parents=True)
    if kind == "venv":
        (prefix / "pyvenv.cfg").write_text("home = /nowhere\n")
    elif kind == "conda":
        (prefix / "conda-meta").mkdir()
    for name in ("python", "python3"):
        path = bindir / name
        path.write_text(_FAKE.format(log=log, torch_rc=0 if torch else 1, prefix=prefix, real=sys.executable))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return bindir / "python"


@pytest.fixture
def repo(tmp_path):
    """A copy of launch/setup.sh under tmp_path/repo (so <repo>/.venv is a test directory), and a log file."""
    (tmp_path / "repo" / "launch").mkdir(parents=True)
    shutil.copy(SETUP, tmp_path / "repo" / "launch" / "setup.sh")
    return tmp_path


def _choose(repo, path_dirs, **env):
    """Source the copied setup.sh, run the choice (and the activation when it does not create a venv); returns
    (interpreter, plan, VIRTUAL_ENV after activation, first PATH entry after activation)."""
    script = ('source "$1"; _dc_choose_python; echo "$DEEPCOMM_PY|$_dc_py_plan"; '
              '[[ $_dc_py_plan == create-venv ]] || { _dc_activate_env; echo "${VIRTUAL_ENV:-}|${PATH%%:*}"; }')
    base = {"PATH": os.pathsep.join([str(d) for d in path_dirs] + ["/usr/bin", "/bin"]), "HOME": str(repo)}
    out = subprocess.run(["bash", "-c", script, "bash", str(repo / "repo" / "launch" / "setup.sh")],
                         env={**base, **env}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    py, plan = lines[0].split("|")
    venv, first = lines[1].split("|") if len(lines) > 1 else (None, None)
    return py, plan, venv, first


def test_unactivated_venv_with_torch_on_path_is_used_as_if_activated(repo):
    log = repo / "log"
    py = _fake_env(repo / "opt" / "torch" / ".venv", True, log)
    got, plan, venv, first = _choose(repo, [py.parent])
    assert (got, plan) == (str(py.parent / "python3"), "use")
    assert venv == str(py.parent.parent) and first == str(py.parent)
    assert not (repo / "repo" / ".venv").exists()


def test_active_env_with_torch_comes_first(repo):
    log = repo / "log"
    active = _fake_env(repo / "active", True, log)
    other = _fake_env(repo / "other", True, log)
    got, plan, _, _ = _choose(repo, [other.parent], VIRTUAL_ENV=str(active.parent.parent))
    assert (got, plan) == (str(active), "use")


def test_active_env_without_torch_defers_to_an_interpreter_with_torch(repo):
    log = repo / "log"
    active = _fake_env(repo / "active", False, log)
    other = _fake_env(repo / "other", True, log)
    got, plan, _, _ = _choose(repo, [other.parent], VIRTUAL_ENV=str(active.parent.parent))
    assert (got, plan) == (str(other.parent / "python3"), "use")


def test_conda_env_with_torch(repo):
    log = repo / "log"
    conda = _fake_env(repo / "conda", True, log, kind="conda")
    plain = _fake_env(repo / "plain", False, log, kind="system")
    got, plan, venv, first = _choose(repo, [plain.parent], CONDA_PREFIX=str(conda.parent.parent))
    assert (got, plan) == (str(conda), "use")
    assert venv == "" and first == str(conda.parent)


def test_repo_venv_with_torch_before_a_system_python_without(repo):
    log = repo / "log"
    venv = _fake_env(repo / "repo" / ".venv", True, log)
    plain = _fake_env(repo / "plain", False, log, kind="system")
    got, plan, _, _ = _choose(repo, [plain.parent])
    assert (got, plan) == (str(venv), "use")


def test_no_torch_anywhere(repo):
    log = repo / "log"
    plain = _fake_env(repo / "plain", False, log, kind="system")
    got, plan, _, _ = _choose(repo, [plain.parent])
    assert (got, plan) == (str(repo / "repo" / ".venv" / "bin" / "python"), "create-venv")
    active = _fake_env(repo / "active", False, log)
    got, plan, _, _ = _choose(repo, [plain.parent], VIRTUAL_ENV=str(active.parent.parent))
    assert (got, plan) == (str(active), "install-torch")


def test_explicit_choices(repo):
    log = repo / "log"
    chosen = _fake_env(repo / "chosen", False, log)
    other = _fake_env(repo / "other", True, log)
    got, plan, _, _ = _choose(repo, [other.parent], DEEPCOMM_PYTHON=str(chosen))
    assert (got, plan) == (str(chosen), "install-torch")
    got, plan, _, _ = _choose(repo, [other.parent], DEEPCOMM_NO_VENV="1")
    assert (got, plan) == (str(other), "use")


def test_full_setup_never_installs_torch_where_one_imports(repo):
    """The whole deepcomm_setup with an unactivated env's interpreter that imports torch: pip is asked for the
    editable install of the checkout, never for torch, and no venv is made."""
    log = repo / "log"
    py = _fake_env(repo / "opt" / "torch" / ".venv", True, log)
    env = {"PATH": os.pathsep.join([str(py.parent), "/usr/bin", "/bin"]), "HOME": str(repo)}
    setup = str(repo / "repo" / "launch" / "setup.sh")
    out = subprocess.run(["bash", "-c", 'source "$1"; deepcomm_setup', "bash", setup], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    calls = log.read_text().splitlines()
    pips = [c for c in calls if c.startswith("-m pip install")]
    assert not any("torch" in c.split() or "torch==2.13.0" in c for c in pips), pips
    assert any(c.endswith("--no-build-isolation --no-deps -e .") for c in pips), pips
    assert "using " + str(py.parent / "python3") in out.stderr
    assert not (repo / "repo" / ".venv").exists()


def test_real_unactivated_venv_interpreter_runs_setup():
    """This test's own virtualenv, not activated, its bin/ on PATH: setup.sh runs its python3."""
    bindir = os.path.dirname(sys.executable)
    if not (os.path.exists(os.path.join(sys.prefix, "pyvenv.cfg")) and os.path.exists(os.path.join(bindir, "python3"))):
        pytest.skip("the test interpreter is not a virtualenv's")
    if os.path.exists(os.path.join(ROOT, ".venv")):
        pytest.skip("this checkout has a .venv, which setup.sh prefers")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "DEEPCOMM_PYTHON")}
    env.update(PATH=os.pathsep.join([bindir, "/usr/bin", "/bin"]), DEEPCOMM_SKIP_SETUP="1", PYTHONPATH=ROOT)
    out = subprocess.run(["bash", SETUP], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"python {os.path.join(bindir, 'python3')} |" in out.stdout and "| torch" in out.stdout, out.stdout
