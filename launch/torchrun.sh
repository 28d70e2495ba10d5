#!/usr/bin/env bash
# Run a Python module or script on every GPU of one node, or of many nodes, with torchrun.
#
#   launch/torchrun.sh [options] -m MODULE [args...]
#   launch/torchrun.sh [options] SCRIPT.py [args...]
#
# Options (each also read from the environment):
#   --nproc N          processes on this node   (NPROC_PER_NODE; default: GPU count, or 2 CPU processes)
#   --nnodes N         nodes                    (NNODES; default 1)
#   --node-rank R      this node's rank         (NODE_RANK; default 0)
#   --master-addr A    rank 0's node            (MASTER_ADDR; needed when nnodes > 1)
#   --master-port P    rendezvous port          (MASTER_PORT; default 29500)
# Uses $PYTHON, else the interpreter launch/setup.sh chose ($DEEPCOMM_PY), else the python on PATH.
set -euo pipefail

export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

PY="${PYTHON:-${DEEPCOMM_PY:-$(command -v python 2>/dev/null || command -v python3)}}"
NPROC="${NPROC_PER_NODE:-}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-}"
MASTER_PORT="${MASTER_PORT:-29500}"

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
need() { [[ $# -ge 2 && -n "$2" ]] || { echo "torchrun.sh: $1 needs a value" >&2; exit 2; }; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --nproc|--nproc-per-node) need "$@"; NPROC="$2"; shift 2 ;;
        --nnodes)      need "$@"; NNODES="$2"; shift 2 ;;
        --node-rank)   need "$@"; NODE_RANK="$2"; shift 2 ;;
        --master-addr) need "$@"; MASTER_ADDR="$2"; shift 2 ;;
        --master-port) need "$@"; MASTER_PORT="$2"; shift 2 ;;
        -h|--help)     usage 0 ;;
        --)            shift; break ;;
        *)             break ;;
    esac
done
[[ $# -ge 1 ]] || { echo "torchrun.sh: give -m MODULE or a script" >&2; usage 2; }

if [[ -z "$NPROC" ]]; then
    NPROC="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
    [[ "$NPROC" -gt 0 ]] || NPROC="${DEEPCOMM_CPU_PROCS:-2}"
fi

if [[ "$NNODES" -eq 1 ]]; then
    exec "$PY" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "$NPROC" "$@"
fi
[[ -n "$MASTER_ADDR" ]] || { echo "torchrun.sh: --master-addr (or MASTER_ADDR) is needed with $NNODES nodes" >&2; exit 2; }
exec "$PY" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --nproc-per-node "$NPROC" "$@"
