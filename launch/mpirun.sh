#!/usr/bin/env bash
# Run a Python module or script under MPI: mpirun starts the processes, deepcomm.launch_mpi turns the MPI ranks
# into a torch.distributed job (rank 0 broadcasts the rendezvous address over MPI) and runs the target.
#
#   launch/mpirun.sh [-np N] [--hostfile FILE] [-- more mpirun options] -m MODULE [args...]
#   launch/mpirun.sh [-np N] [--hostfile FILE] SCRIPT.py [args...]
#
#   -np N            processes in total   (NP; default: GPUs on this host, or 2 CPU processes)
#   --hostfile FILE  hosts to run on      (HOSTFILE; Open MPI: "host slots=8" per line)
#   MPIRUN_ARGS      extra mpirun options, e.g. "--map-by ppr:8:node --bind-to none"
#   LAUNCH_MPI_ARGS  options of deepcomm.launch_mpi, e.g. "--backend gloo --master-port 29600"
# Needs mpirun (Open MPI or MPICH) and mpi4py in $PYTHON, else $DEEPCOMM_PY (launch/setup.sh), else the python on PATH.
#
# Examples:
#   bash launch/mpirun.sh -np 8 -m deepcomm.bench --json results/mpi.json
#   bash launch/mpirun.sh -np 16 --hostfile hosts launch/smoke_dispatch.py
set -euo pipefail

export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

PY="${PYTHON:-${DEEPCOMM_PY:-$(command -v python 2>/dev/null || command -v python3)}}"
NP="${NP:-}"
HOSTFILE="${HOSTFILE:-}"
EXTRA=()

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
need() { [[ $# -ge 2 && -n "$2" ]] || { echo "mpirun.sh: $1 needs a value" >&2; exit 2; }; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        -np|-n|--np)   need "$@"; NP="$2"; shift 2 ;;
        --hostfile)    need "$@"; HOSTFILE="$2"; shift 2 ;;
        -h|--help)     usage 0 ;;
        --)            shift; while [[ $# -gt 0 && "$1" != "-m" && "$1" != *.py ]]; do EXTRA+=("$1"); shift; done ;;
        *)             break ;;
    esac
done
[[ $# -ge 1 ]] || { echo "mpirun.sh: give -m MODULE or a script" >&2; usage 2; }

command -v mpirun >/dev/null 2>&1 || { echo "mpirun.sh: mpirun not found (install Open MPI or MPICH)" >&2; exit 127; }
"$PY" -c 'import mpi4py' 2>/dev/null || { echo "mpirun.sh: mpi4py is missing in $PY (pip install mpi4py)" >&2; exit 127; }

if [[ -z "$NP" ]]; then
    NP="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
    [[ "$NP" -gt 0 ]] || NP="${DEEPCOMM_CPU_PROCS:-2}"
fi

args=(-np "$NP")
[[ -n "$HOSTFILE" ]] && args+=(--hostfile "$HOSTFILE")
# pass the environment this job needs to every rank (Open MPI: -x NAME; MPICH/Hydra: -genvlist)
envs=()
# (every DEEPCOMM_*, NVSHMEM_*, NCCL_*, UCX_* and FI_* variable too: the transport settings of docs/internode.md)
for e in TORCH_SYMM_MEM_DISABLE_MULTICAST PATH PYTHONPATH VIRTUAL_ENV LD_LIBRARY_PATH CUDA_HOME \
         $(compgen -e | grep -E '^(DEEPCOMM|NVSHMEM|NCCL|UCX|FI)_' || true); do
    [[ -n "${!e:-}" ]] && envs+=("$e")
done
if mpirun --version 2>&1 | grep -qi "open mpi\|open-rte"; then
    for e in "${envs[@]}"; do args+=(-x "$e"); done
    [[ "$(id -u)" -eq 0 ]] && args+=(--allow-run-as-root)
else
    args+=(-genvlist "$(IFS=,; echo "${envs[*]}")")
fi
# shellcheck disable=SC2086
exec mpirun "${args[@]}" ${MPIRUN_ARGS:-} "${EXTRA[@]}" "$PY" -m deepcomm.launch_mpi ${LAUNCH_MPI_ARGS:-} "$@"
