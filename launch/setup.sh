#!/usr/bin/env bash
# Shared set-up for the launch scripts (source it, or run it: `bash launch/setup.sh`).
#
# - Python: the first of these that imports torch is used as is, activated or not (no venv is made over it):
#   $DEEPCOMM_PYTHON; the active environment (VIRTUAL_ENV or CONDA_PREFIX); <repo>/.venv; `python3` / `python` on
#   PATH (e.g. a GPU image's unactivated virtualenv interpreter). DEEPCOMM_NO_VENV=1 takes the current Python as
#   is. Only where none imports torch: the active environment, else a new <repo>/.venv (--system-site-packages),
#   gets `pip install torch==2.13.0`. torch is never installed where one is importable.
# - build/test deps that are missing: setuptools, wheel, pybind11, pytest, numpy; matplotlib if it installs.
# - deepcomm itself: `pip install --no-build-isolation --no-deps -e .` (compiles the CUDA extension when nvcc is
#   found), redone only when setup.py / pyproject.toml / csrc / ptx changed since the last install here.
# DEEPCOMM_SKIP_SETUP=1 skips everything but choosing the Python and the environment variables;
# DEEPCOMM_FORCE_SETUP=1 reinstalls.

DEEPCOMM_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export DEEPCOMM_ROOT

# No NVLink multicast / NVLS anywhere (not available on the machines we lend; see KINDS notes).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

_dc_log() { echo "[deepcomm setup] $*" >&2; }

_dc_imports_torch() { [[ -n "$1" && -x "$1" ]] && "$1" -c 'import torch' >/dev/null 2>&1; }

_dc_active_python() {  # the interpreter of an activated virtualenv or conda environment, if any
    local prefix
    for prefix in "${VIRTUAL_ENV:-}" "${CONDA_PREFIX:-}"; do
        [[ -n "$prefix" ]] || continue
        if [[ -x "$prefix/bin/python" ]]; then echo "$prefix/bin/python"; return 0; fi
        if [[ -x "$prefix/bin/python3" ]]; then echo "$prefix/bin/python3"; return 0; fi
    done
    return 1
}

# Sets DEEPCOMM_PY (the interpreter) and _dc_py_plan: "use" (it imports torch), "install-torch" (an active
# environment without torch, nothing else has one) or "create-venv" (no torch anywhere: make <repo>/.venv).
_dc_choose_python() {
    local candidate
    _dc_py_plan=use
    if [[ -n "${DEEPCOMM_PYTHON:-}" ]]; then
        DEEPCOMM_PY="$(command -v "$DEEPCOMM_PYTHON" 2>/dev/null || echo "$DEEPCOMM_PYTHON")"
        _dc_imports_torch "$DEEPCOMM_PY" || _dc_py_plan=install-torch
        return 0
    fi
    if [[ "${DEEPCOMM_NO_VENV:-0}" == "1" ]]; then
        DEEPCOMM_PY="$(command -v python 2>/dev/null || command -v python3)"
        _dc_imports_torch "$DEEPCOMM_PY" || _dc_py_plan=install-torch
        return 0
    fi
    for candidate in "$(_dc_active_python)" "$DEEPCOMM_ROOT/.venv/bin/python" \
                     "$(command -v python3 2>/dev/null)" "$(command -v python 2>/dev/null)"; do
        if _dc_imports_torch "$candidate"; then
            DEEPCOMM_PY="$candidate"
            return 0
        fi
    done
    if DEEPCOMM_PY="$(_dc_active_python)"; then
        _dc_py_plan=install-torch
        return 0
    fi
    DEEPCOMM_PY="$DEEPCOMM_ROOT/.venv/bin/python"
    if [[ -x "$DEEPCOMM_PY" ]]; then _dc_py_plan=install-torch; else _dc_py_plan=create-venv; fi
}

_dc_activate_env() {
    _dc_choose_python
    if [[ "$_dc_py_plan" == "create-venv" ]]; then
        _dc_log "no Python here imports torch: creating $DEEPCOMM_ROOT/.venv"
        python3 -m venv --system-site-packages "$DEEPCOMM_ROOT/.venv"
        _dc_py_plan=install-torch
    fi
    # an environment's interpreter is used as if activated (child processes and launchers find it on PATH);
    # a system interpreter leaves PATH as it is
    local prefix
    prefix="$(cd "$(dirname "$DEEPCOMM_PY")/.." && pwd)"
    if [[ -f "$prefix/pyvenv.cfg" || -d "$prefix/conda-meta" ]]; then
        [[ -f "$prefix/pyvenv.cfg" ]] && export VIRTUAL_ENV="$prefix"
        PATH="$prefix/bin:$PATH"
    fi
    export PATH DEEPCOMM_PY
}

_dc_missing_modules() {  # args MODULE=DIST[>=MIN]; prints the pip specs of those missing or too old
    "$DEEPCOMM_PY" - "$@" <<'PY'
import importlib.metadata as md, importlib.util, re, sys

def vtuple(v):
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])

out = []
for arg in sys.argv[1:]:
    mod, spec = arg.split("=", 1)
    dist, _, minimum = spec.partition(">=")
    if importlib.util.find_spec(mod) is None:
        out.append(spec)
    elif minimum:
        try:
            if vtuple(md.version(dist)) < vtuple(minimum):
                out.append(spec)
        except md.PackageNotFoundError:
            out.append(spec)
print(" ".join(out))
PY
}

_dc_needs_install() {
    local stamp="$1"
    [[ "${DEEPCOMM_FORCE_SETUP:-0}" == "1" ]] && return 0
    [[ -f "$stamp" ]] || return 0
    # deepcomm must resolve to this checkout
    "$DEEPCOMM_PY" - "$DEEPCOMM_ROOT" <<'PY' || return 0
import os, sys, importlib.util
spec = importlib.util.find_spec("deepcomm")
ok = spec is not None and spec.origin is not None and \
     os.path.realpath(spec.origin).startswith(os.path.realpath(sys.argv[1]) + os.sep)
sys.exit(0 if ok else 1)
PY
    local changed
    changed="$(cd "$DEEPCOMM_ROOT" && find setup.py pyproject.toml setup.cfg csrc ptx -newer "$stamp" -type f 2>/dev/null | head -n 1)"
    [[ -n "$changed" ]]
}

deepcomm_setup() {
    _dc_activate_env
    if [[ "${DEEPCOMM_SKIP_SETUP:-0}" == "1" ]]; then
        return 0
    fi
    local pip=("$DEEPCOMM_PY" -m pip install --disable-pip-version-check)
    if [[ "$_dc_py_plan" == "install-torch" ]]; then
        _dc_log "no torch importable from $DEEPCOMM_PY: pip install torch==2.13.0"
        "${pip[@]}" torch==2.13.0
    else
        _dc_log "using $DEEPCOMM_PY (imports torch)"
    fi
    local missing
    # setuptools>=77: pyproject.toml's SPDX `license` string needs it
    missing="$(_dc_missing_modules setuptools='setuptools>=77' wheel=wheel pybind11='pybind11>=2.10' pytest=pytest numpy=numpy)"
    if [[ -n "$missing" ]]; then
        _dc_log "installing $missing"
        # shellcheck disable=SC2086
        "${pip[@]}" $missing
    fi
    if [[ -z "$(_dc_missing_modules matplotlib=matplotlib)" ]]; then :; else
        "${pip[@]}" matplotlib >/dev/null 2>&1 || _dc_log "matplotlib not installed (plots will be skipped)"
    fi
    local stamp_dir stamp
    stamp_dir="$("$DEEPCOMM_PY" -c 'import sys; print(sys.prefix)')"
    stamp="$stamp_dir/.deepcomm-setup-$(printf '%s' "$DEEPCOMM_ROOT" | cksum | cut -d' ' -f1)"
    [[ -w "$stamp_dir" ]] || stamp="$DEEPCOMM_ROOT/.deepcomm-setup-stamp"
    if _dc_needs_install "$stamp"; then
        _dc_log "pip install --no-build-isolation --no-deps -e $DEEPCOMM_ROOT"
        (cd "$DEEPCOMM_ROOT" && "${pip[@]}" --no-build-isolation --no-deps -e .)
        touch "$stamp"
    fi
}

deepcomm_gpu_count() {
    "$DEEPCOMM_PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then   # run directly
    set -euo pipefail
    deepcomm_setup
    "$DEEPCOMM_PY" -c 'import sys, deepcomm, torch
print("python", sys.argv[1], "| deepcomm", deepcomm.__file__, "| torch", torch.__version__)' "$DEEPCOMM_PY"
fi
