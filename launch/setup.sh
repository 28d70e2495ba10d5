#!/usr/bin/env bash
# Shared set-up for the launch scripts (source it, or run it: `bash launch/setup.sh`).
#
# - Python environment: the active one when VIRTUAL_ENV is set or DEEPCOMM_NO_VENV=1, else <repo>/.venv
#   (created with --system-site-packages, so a torch already installed on the machine, e.g. a CUDA build on a
#   GPU host, is used as is).
# - torch: `pip install torch==2.13.0` only when torch is not importable (on the CPU machines pip takes that
#   wheel from disk; nothing downloads a torch).
# - build/test deps that are missing: setuptools, wheel, pybind11, pytest, numpy; matplotlib if it installs.
# - deepcomm itself: `pip install --no-build-isolation --no-deps -e .` (compiles the CUDA extension when nvcc is
#   found), redone only when setup.py / pyproject.toml / csrc / ptx changed since the last install here.
# DEEPCOMM_SKIP_SETUP=1 skips everything but the environment variables; DEEPCOMM_FORCE_SETUP=1 reinstalls.

DEEPCOMM_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export DEEPCOMM_ROOT

# No NVLink multicast / NVLS anywhere (not available on the machines we lend; see KINDS notes).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

_dc_log() { echo "[deepcomm setup] $*" >&2; }

_dc_activate_env() {
    if [[ -n "${VIRTUAL_ENV:-}" || "${DEEPCOMM_NO_VENV:-0}" == "1" ]]; then
        DEEPCOMM_PY="$(command -v python 2>/dev/null || command -v python3)"
        return 0
    fi
    local venv="$DEEPCOMM_ROOT/.venv"
    if [[ ! -x "$venv/bin/python" ]]; then
        _dc_log "creating $venv"
        python3 -m venv --system-site-packages "$venv"
    fi
    # shellcheck disable=SC1091
    source "$venv/bin/activate"
    DEEPCOMM_PY="$venv/bin/python"
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
    if ! "$DEEPCOMM_PY" -c "import torch" >/dev/null 2>&1; then
        _dc_log "torch not importable: pip install torch==2.13.0"
        "${pip[@]}" torch==2.13.0
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
    "$DEEPCOMM_PY" -c 'import deepcomm, torch; print("deepcomm", deepcomm.__file__, "| torch", torch.__version__)'
fi
