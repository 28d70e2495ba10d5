#!/usr/bin/env bash
# Normal mode on one GPU (world size 1): build, the world-size-1 GPU tests, the host-time profile and the benchmark
# (normal mode, 128 and 4096 tokens). With a second tree in $BASE_TREE (e.g. the previous release, untracked and
# git-ignored), its host-time profile runs first, for an A/B in one run. Logs and JSON go to $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
PY=python3
summary="$OUT/summary.txt"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > "$summary" 2>&1

install_here() {
  local t0=$(date +%s)
  if ! timeout 300 $PY -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"; echo "BUILD FAILED in $PWD"; return 1
  fi
  echo "build $PWD: $(( $(date +%s) - t0 )) s" | tee -a "$summary"
}

if [[ -n "${BASE_TREE:-}" && -d "$BASE_TREE" ]]; then
  (cd "$BASE_TREE" && install_here && DEEPCOMM_COMMIT=base timeout 240 $PY "$OLDPWD/dev/profile_host.py" \
     --json "$OUT/host_base.json" 2>&1 | tee "$OUT/host_base.log" | tail -12)
fi
install_here || exit 1
rm -f "$OUT/build.log"
timeout 300 $PY -m pytest -q -ra -m gpu tests/normal/test_normal_world1.py ${EXTRA_TESTS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
echo "gpu tests rc=${PIPESTATUS[0]}" | tee -a "$summary"
timeout 240 $PY dev/profile_host.py --json "$OUT/host_new.json" 2>&1 | tee "$OUT/host_new.log" | tail -12
timeout 240 torchrun --nproc-per-node 1 -m deepcomm.bench --modes normal --tokens 128,4096 --num-sms 8,24 \
  --systems deepcomm,a2a --no-progress --json "$OUT/bench_ws1.json" 2>&1 | tail -30
