#!/usr/bin/env bash
# One full check on a GPU machine: build, GPU tests, benchmark. Logs and JSON go to $OUT (default ./out).
#   bash dev/device_check.sh [quick|full|tests|bench|soak|verify|sanitize|ll|ll-ab|ll-bench-ab|ll-settings|round|
#                                internode|parts-ab]
#   (default quick; full = tests + soak + sanitize + bench, more than one device call's 600 s now: run its modes
#    apart; verify = tests + soak, no bench; sanitize = compute-sanitizer memcheck/racecheck/synccheck on the
#    intranode kernels, dev/sanitize.sh; ll = the low-latency loop: its GPU tests, the low-latency benchmark and
#    the phase trace (dev/profile_low_latency.py), about 4 minutes; round = every GPU test and the
#    10k soak in one device call (under 600 s; run `sanitize` as a second call); ll-ab = an A/B of a kernel change
#    in one call: the low-latency GPU tests and benchmark on the tree as it is (A), then again with the patch file
#    $AB_PATCH applied (B; e.g. `git diff main exp/branch > ab.patch`, an untracked file in the tree), about 7 minutes;
#    internode = the internode GPU tests (emulated NIC and NVSHMEM transports) and the internode benchmark;
#    parts-ab = the host parts of a normal-mode call of the tree and of each patch in $AB_PATCHES, two rounds;
#    shared WORLD = the multi-rank GPU suite with WORLD ranks (default 4) all on GPU 0 under MPS (launch/with_mps.sh,
#    docs/testing.md), the killed-peer tests last, then the soak at WORLD ranks; within ~540 s in all; SHARED_FILES,
#    WS1_FIRST, PROFILE_FIRST, BENCH_FIRST and SHARED_TESTS_ONLY below pick the parts)
# Meant for a 2 x H200 host (shared: one H200); every step is bounded by `timeout` so the script always ends.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
MODE="${1:-quick}"
T0=$(date +%s)
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
summary="$OUT/summary.txt"
{
  date -u; git rev-parse --short HEAD 2>/dev/null || echo "no commit"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m | head -5
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
} > "$summary" 2>&1
cat "$summary"

# Build and install the extension in place; $1 names the build in the log lines (empty for the first).
build() {
  local t0
  t0=$(date +%s)
  if ! timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
    tail -60 "$OUT/build.log"; echo "BUILD${1:+ $1} FAILED"; exit 1
  fi
  rm -f "$OUT/build.log"  # keep $OUT to the few files worth reading
  echo "build${1:+ $1}: $(( $(date +%s) - t0 )) s" | tee -a "$summary"
}

build ""
python3 -c 'import deepcomm, deepcomm._C as C; print("extension ok; gpus", C.device_count(), "backends", deepcomm.available_backends())' | tee -a "$summary"

# shared WORLD: every multi-rank GPU test with WORLD ranks sharing GPU 0 (over gloo, under MPS), in order of what
# matters most, so that the time limit cuts the least; the killed-peer tests run last (a client killed under MPS
# must not take the others' server down mid-suite); then the soak. Seconds left of the ~540 s: left.
left() { echo $(( T0 + ${SHARED_BUDGET_S:-540} - $(date +%s) )); }
if [[ "$MODE" == shared ]]; then
  WORLD="${2:-4}"
  export DEEPCOMM_TEST_SHARED_GPU=1 DEEPCOMM_TEST_WORLD="$WORLD" DEEPCOMM_TEST_FAILURES_AT_ONCE=1
  # SHARED_FILES (space-separated test file names) picks and orders a subset; WS1_FIRST=1 runs the world-size-1
  # tests (tests/normal/test_normal_world1.py, the drop-in at one rank) before the shared ones
  files=(test_intranode test_ll_kernels test_fp8_combine_gpu test_internode test_graph_async test_shrink_gpu
         test_faults test_topology_gpu test_dropin_gpu test_compile_gpu test_agreement_gpu test_cupy test_memory
         test_internode_ll test_ll_puts test_nvshmem test_internode_nvshmem test_device_qp test_ptx)
  [[ -n "${SHARED_FILES:-}" ]] && read -r -a files <<< "$SHARED_FILES"
  if [[ "${WS1_FIRST:-0}" == 1 ]]; then
    t0=$(date +%s)
    env -u DEEPCOMM_TEST_SHARED_GPU -u DEEPCOMM_TEST_WORLD timeout 150 python3 -m pytest -q -ra -m gpu -p no:cacheprovider \
      tests/normal/test_normal_world1.py tests/api/test_dropin_gpu.py > "$OUT/gpu_tests_ws1.log" 2>&1
    echo "world-size-1 gpu tests: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$summary"
    tail -15 "$OUT/gpu_tests_ws1.log"
  fi
  if [[ "${PROFILE_FIRST:-0}" == 1 ]]; then  # the host-time profile (one rank), with cProfile of each call
    env -u DEEPCOMM_TEST_SHARED_GPU -u DEEPCOMM_TEST_WORLD timeout 200 python3 dev/profile_host.py \
      --json "$OUT/host_time.json" --cprofile "$OUT/host_cprofile.txt" > "$OUT/host_time.log" 2>&1
    echo "host-time profile: rc=$?" | tee -a "$summary"
    tail -12 "$OUT/host_time.log"
  fi
  if [[ "${BENCH_FIRST:-0}" == 1 ]]; then  # the normal-mode benchmark at world size 1 (one rank on the GPU)
    env -u DEEPCOMM_TEST_SHARED_GPU -u DEEPCOMM_TEST_WORLD timeout 150 torchrun --nproc-per-node 1 -m deepcomm.bench \
      --modes normal --tokens 128,4096 --num-sms 8,24 --systems deepcomm,a2a --no-progress \
      --json "$OUT/bench_ws1.json" > "$OUT/bench_ws1.log" 2>&1
    echo "benchmark, world size 1: rc=$?" | tee -a "$summary"
    tail -14 "$OUT/bench_ws1.log"
  fi
  paths=()
  for f in "${files[@]}"; do paths+=(tests/*/"$f".py); done  # test file names are unique across subjects
  t0=$(date +%s)
  reserve=150; [[ "${SHARED_TESTS_ONLY:-0}" == 1 ]] && reserve=10  # room for the killed-peer tests and the soak
  timeout $(( $(left) - reserve )) bash launch/with_mps.sh python3 -m pytest -v -ra -m gpu --durations=15 \
    -p no:cacheprovider -k "not killed" "${paths[@]}" > "$OUT/gpu_tests_shared$WORLD.log" 2>&1
  echo "shared gpu tests, $WORLD ranks on GPU 0: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$OUT/gpu_tests_shared$WORLD.log" | tail -40
  [[ "${SHARED_TESTS_ONLY:-0}" == 1 ]] && exit 0  # SHARED_TESTS_ONLY=1: no killed-peer tests, no soak
  t0=$(date +%s)
  timeout $(( $(left) - 75 )) bash launch/with_mps.sh python3 -m pytest -q -ra -m gpu -p no:cacheprovider \
    -k killed tests/errors/test_faults.py tests/low_latency/test_shrink_gpu.py >> "$OUT/gpu_tests_shared$WORLD.log" 2>&1
  echo "shared killed-peer tests: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  tail -4 "$OUT/gpu_tests_shared$WORLD.log"
  t0=$(date +%s)
  # the soak's --seconds clock starts after start-up; leave room for that and teardown
  soak_s=$(( $(left) - 45 )); (( soak_s < 10 )) && soak_s=10
  timeout $(( soak_s + 40 )) bash launch/with_mps.sh python3 -m deepcomm.soak --world-size "$WORLD" \
    --iterations 3000 --seconds "$soak_s" > "$OUT/soak_shared$WORLD.log" 2>&1
  echo "soak, $WORLD ranks on GPU 0: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  grep -A12 "deepcomm soak" "$OUT/soak_shared$WORLD.log" | tee -a "$summary"
  tail -5 "$OUT/soak_shared$WORLD.log"
  exit 0
fi

# The low-latency GPU tests, then the low-latency benchmark into $OUT/bench_ll$1.json (no phase trace).
ll_tests_and_bench() {
  local tag="$1" t0
  t0=$(date +%s)
  timeout 240 python3 -m pytest -q -ra -m gpu tests/low_latency/test_ll_kernels.py tests/low_latency/test_shrink_gpu.py \
    tests/errors/test_faults.py > "$OUT/gpu_tests$tag.log" 2>&1
  echo "low-latency gpu tests$tag: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  tail -4 "$OUT/gpu_tests$tag.log"
  DEEPCOMM_LL_TRACE=0 timeout 200 python3 -m deepcomm.bench --modes low_latency --no-progress \
    --json "$OUT/bench_ll$tag.json" 2>&1 | grep "deepcomm.*cuda-graph\|hook" | tee -a "$summary"
}

if [[ "$MODE" == ll-ab ]]; then
  [[ -f "${AB_PATCH:-}" ]] || { echo "ll-ab: set AB_PATCH to a patch file in the tree"; exit 1; }
  ll_tests_and_bench "-A"
  git apply "$AB_PATCH" || { echo "ll-ab: the patch does not apply"; exit 1; }
  build B
  ll_tests_and_bench "-B"
  exit 0
fi

# The low-latency benchmark of deepcomm alone at 1/128/256 tokens, its CUDA-graph rows as "op dtype tokens median;"
# on one line under "== label"; $2 (optional): environment settings for the run ("NAME=value NAME=value").
quick_ll_bench() {
  echo "== $1" | tee -a "$summary"
  # shellcheck disable=SC2086  # $2 is a list of NAME=value words
  env ${2:-} timeout 100 python3 -m deepcomm.bench --modes low_latency --ll-tokens 1,128,256 --systems deepcomm \
    --no-progress 2>&1 | grep "cuda-graph" | awk '{print $3, $4, $5, $9}' | tr '\n' ';' | tee -a "$summary"
  echo | tee -a "$summary"
}

# The A/B loop of ll-bench-ab and parts-ab: in two rounds (so that drift shows), `$2 LABEL` on the tree as it is,
# then on each patch in $AB_PATCHES (space-separated patch files in the tree, e.g. `git diff main exp/x > x.patch`)
# applied alone and rebuilt, labels "tree-rN" and "<patch name>-rN"; `$3 ROUND PATCH` (optional) right after each
# patch's measurement, on its tree.
ab_rounds() {
  local mode="$1" measure="$2" after="${3:-}" round p
  read -ra patches <<< "${AB_PATCHES:-}"
  [[ ${#patches[@]} -gt 0 ]] || { echo "$mode: set AB_PATCHES to patch files in the tree"; exit 1; }
  for round in 1 2; do
    "$measure" "tree-r$round"
    for p in "${patches[@]}"; do
      git apply "$p" || { echo "$mode: $p does not apply"; exit 1; }
      build "$p"
      "$measure" "$(basename "$p" .patch)-r$round"
      [[ -n "$after" ]] && "$after" "$round" "$p"
      git apply -R "$p"
    done
    [[ $round == 1 ]] && build "tree"
  done
}

# ll-bench-ab: the low-latency benchmark only (deepcomm, 1/128/256 tokens, CUDA graphs) of the tree as it is and of
# each patch in $AB_PATCHES (ab_rounds); no tests (run the winner's with ll-ab or ll-settings); about 40 s per build
# and benchmark
if [[ "$MODE" == ll-bench-ab ]]; then
  ab_rounds ll-bench-ab quick_ll_bench
  exit 0
fi

# The host parts of a normal-mode call at world size 1 (dev/profile_host_parts.py, both launch modes' splits) into
# $OUT/ab/parts_$1.json, its split lines into the summary; with AB_TRACE=1 the notify trace too (both launch modes),
# with AB_KERNELS=1 each call's kernel times and span (dev/profile_kernels.py, 24 SMs).
quick_parts() {
  mkdir -p "$OUT/ab"
  echo "== $1" | tee -a "$summary"
  timeout 120 python3 dev/profile_host_parts.py --json "$OUT/ab/parts_$1.json" > "$OUT/ab/parts_$1.log" 2>&1
  python3 - "$OUT/ab/parts_$1.json" <<'PY' | tee -a "$summary"
import json, sys
d = json.load(open(sys.argv[1]))["parts_us"]
for k in ("split: whole call", "split: crossing: counts seen", "split, one launch: whole call",
          "split, one launch: crossing: counts seen", "buf.dispatch cached bf16", "buf.combine"):
    print(f"  {k:45s} {d.get(k)}")
PY
  if [[ "${AB_KERNELS:-0}" == 1 ]]; then  # each call's kernels and span at 128 and 4096 tokens, 24 SMs
    timeout 150 python3 dev/profile_kernels.py --sms 24 --json "$OUT/ab/kernels_$1.json" > "$OUT/ab/kernels_$1.log" 2>&1
    grep -E "^(fresh|cached|combine|graph)" "$OUT/ab/kernels_$1.log" | cut -c1-75 | tee -a "$summary"
  fi
  if [[ "${AB_TRACE:-0}" == 1 ]]; then
    timeout 150 python3 dev/profile_sweep.py --trace-only --json "$OUT/ab/trace_$1.json" 2>&1 \
      | grep -A10 "notify trace" > "$OUT/ab/trace_$1.log"
    grep -E "notify trace|host counts written" "$OUT/ab/trace_$1.log" | tee -a "$summary"
  fi
}

# parts-ab: the host parts (quick_parts) of the tree as it is and of each patch in $AB_PATCHES (ab_rounds); then,
# with AB_TESTS (test files, e.g. "tests/normal/x.py"), those GPU tests on the last patch's tree in the second round.
# About 45 s per build and profile (70 with AB_TRACE=1).
parts_ab_tests() {
  [[ $1 == 2 && -n "${AB_TESTS:-}" && "$2" == "${patches[-1]}" ]] || return 0
  local t0
  t0=$(date +%s)
  # shellcheck disable=SC2086  # a list of test files
  timeout 200 python3 -m pytest -q -ra -m gpu -p no:cacheprovider $AB_TESTS > "$OUT/ab/gpu_tests.log" 2>&1
  echo "gpu tests on $2: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  tail -6 "$OUT/ab/gpu_tests.log"
}
if [[ "$MODE" == parts-ab ]]; then
  ab_rounds parts-ab quick_parts parts_ab_tests
  tar czf "$OUT/ab.tgz" -C "$OUT" ab && rm -rf "$OUT/ab"  # one archive: $OUT stays a few files
  exit 0
fi

# ll-settings: the low-latency GPU tests once, then the low-latency benchmark (deepcomm only, 1/128/256 tokens)
# under each environment in $LL_SETTINGS (';'-separated, e.g. "DEEPCOMM_LL_PDL=0;DEEPCOMM_LL_PDL=1"; an A/B of
# run-time settings with no rebuild), then the full low-latency sweep with NCCL under the defaults into
# bench_ll.json; about 2 minutes plus one per setting
if [[ "$MODE" == ll-settings ]]; then
  t0=$(date +%s)
  timeout 240 python3 -m pytest -q -ra -m gpu tests/low_latency/test_ll_kernels.py tests/low_latency/test_ll_puts.py \
    tests/normal/test_graph_async.py > "$OUT/gpu_tests.log" 2>&1
  echo "low-latency gpu tests: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  tail -6 "$OUT/gpu_tests.log"
  IFS=';' read -ra settings <<< "${LL_SETTINGS:-DEEPCOMM_LL_PDL=0}"
  for setting in "${settings[@]}"; do quick_ll_bench "$setting" "$setting"; done
  timeout 150 python3 -m deepcomm.bench --modes low_latency --no-progress --json "$OUT/bench_ll.json" 2>&1 \
    | grep "deepcomm\|nccl" | tee -a "$summary"
  exit 0
fi

if [[ "$MODE" == internode ]]; then
  t0=$(date +%s)
  timeout 300 python3 -m pytest -q -ra -m gpu tests/internode/test_internode.py tests/internode/test_internode_nvshmem.py \
    > "$OUT/gpu_tests.log" 2>&1
  echo "internode gpu tests: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  tail -15 "$OUT/gpu_tests.log"
  t0=$(date +%s)
  timeout 200 python3 -m deepcomm.bench --modes internode --gpus-per-node 1 --tokens 512,4096 --no-progress \
    --json "$OUT/bench_internode.json" 2>&1 | tail -30 | tee "$OUT/bench.log"
  echo "bench internode: rc=${PIPESTATUS[0]} $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  exit 0
fi

if [[ "$MODE" == ll ]]; then
  ll_tests_and_bench ""
  timeout 120 python3 dev/profile_low_latency.py > "$OUT/profile.log" 2>&1
  echo "profile: rc=$? (profile.log)" | tee -a "$summary"
  exit 0
fi

if [[ "$MODE" == round ]]; then
  t0=$(date +%s)
  # the GPU tests took 325 s on 2026-11-30 (35; test_internode_ll.py, 3 more, takes about 30 s), and the soak then
  # has 140 s (10k iterations took 88-94 s)
  timeout 420 python3 -m pytest -q -ra -m gpu tests > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  tail -8 "$OUT/gpu_tests.log"
  t0=$(date +%s)
  # the soak's --seconds clock starts after start-up (processes, NCCL, Buffers): leave room for that and teardown
  timeout 140 python3 -m deepcomm.soak --backend cuda --iterations 10000 --seconds 100 > "$OUT/soak.log" 2>&1
  echo "soak: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  grep -A8 "deepcomm soak" "$OUT/soak.log" | tee -a "$summary"
  exit 0
fi

if [[ "$MODE" != bench && "$MODE" != soak && "$MODE" != sanitize ]]; then
  t0=$(date +%s)
  timeout 540 python3 -m pytest -q -ra -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  echo "gpu tests: rc=${PIPESTATUS[0]} $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  # the real-MPI launcher test (skips where mpirun or mpi4py is missing) and the example training on the GPUs
  timeout 120 python3 -m pytest -q -ra tests/tooling/test_launch.py -k mpirun 2>&1 | tee -a "$OUT/gpu_tests.log" | tail -3
  timeout 180 python3 examples/train_moe.py --device cuda --steps 200 2>&1 | tail -4 | tee -a "$summary"
  echo "train_moe on GPUs: rc=${PIPESTATUS[0]}" | tee -a "$summary"
fi

if [[ "$MODE" == full || "$MODE" == soak || "$MODE" == verify ]]; then
  t0=$(date +%s)
  # 10,000 iterations are meant to take well under 5 minutes; --seconds stops it early (printing its counts) if not
  timeout 420 python3 -m deepcomm.soak --backend cuda --iterations 10000 --seconds "${SOAK_SECONDS:-360}" \
    > "$OUT/soak.log" 2>&1
  echo "soak: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  grep -A12 "deepcomm soak" "$OUT/soak.log" | head -30
fi

if [[ "$MODE" == full || "$MODE" == sanitize ]]; then
  t0=$(date +%s)
  OUT="$OUT" timeout 560 bash dev/sanitize.sh
  echo "sanitize: rc=$? $(( $(date +%s) - t0 )) s (log: sanitize.log)" | tee -a "$summary"
fi

if [[ "$MODE" != tests && "$MODE" != soak && "$MODE" != verify && "$MODE" != sanitize ]]; then
  t0=$(date +%s)
  bench_args=(--json "$OUT/bench.json" --no-progress)
  if [[ "$MODE" == quick ]]; then bench_args+=(--quick); else bench_args+=(--plots "$OUT"); fi
  timeout 480 python3 -m deepcomm.bench "${bench_args[@]}" 2>&1 | tee "$OUT/bench.log" | tail -60
  echo "bench: rc=${PIPESTATUS[0]} $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  # the GPUs posing as nodes of 1 GPU: internode normal mode over GPU-posted WQEs and the device emulated NIC
  t0=$(date +%s)
  timeout 240 python3 -m deepcomm.bench --modes internode --gpus-per-node 1 --tokens 512,4096 --no-progress \
    --json "$OUT/bench_internode.json" 2>&1 | tail -30 | tee -a "$OUT/bench.log"
  echo "bench internode: rc=${PIPESTATUS[0]} $(( $(date +%s) - t0 )) s" | tee -a "$summary"
fi
