#!/usr/bin/env bash
# The main job: set up if needed, then run the benchmark (docs/benchmarks/README.md) on the best backend.
#   GPUs:   torchrun over all local GPUs, deepcomm backend auto (CUDA kernels when built), full workload.
#   no GPU: `python -m deepcomm.bench` on 2 CPU processes (gloo, reference backend), short workload.
# Any arguments go to deepcomm.bench (see `python -m deepcomm.bench --help`). Without --json, results go to
# results/bench-<time>.{json,csv} and plots (when matplotlib is there) to results/.
set -euo pipefail
# shellcheck source=launch/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
deepcomm_setup
cd "$DEEPCOMM_ROOT"

args=("$@")
if [[ " $* " != *" --json"* ]]; then
    out="${DEEPCOMM_RESULTS_DIR:-results}"
    stamp="$(date +%Y%m%d-%H%M%S)"
    mkdir -p "$out"
    args+=(--json "$out/bench-$stamp.json" --csv "$out/bench-$stamp.csv" --plots "$out/plots-$stamp")
fi

gpus="$(deepcomm_gpu_count)"
if [[ "$gpus" -gt 0 ]]; then
    echo "[deepcomm bench] $gpus GPU(s): torchrun, backend auto" >&2
    exec bash "$DEEPCOMM_ROOT/launch/torchrun.sh" --nproc "$gpus" -m deepcomm.bench --backend auto "${args[@]}"
fi
echo "[deepcomm bench] no GPU: ${DEEPCOMM_CPU_PROCS:-2} CPU processes, reference backend" >&2
exec "$DEEPCOMM_PY" -m deepcomm.bench --device cpu --world-size "${DEEPCOMM_CPU_PROCS:-2}" "${args[@]}"
