#!/usr/bin/env bash
# Several GPU checks of different world sizes in one run on a one-GPU machine: build once, then each STEP in order,
# each bounded so that the whole run ends within MATRIX_BUDGET_S (default 540) seconds. Logs go to $OUT.
#   bash dev/device_matrix.sh STEP...
#   STEP = profile            the host-time profile at world size 1 (dev/profile_host.py, 128 and 4096 tokens),
#                             with each call's cProfile in $OUT/cprofile.txt
#        | parts              the host cost of each piece of a call, timed alone (dev/profile_host_parts.py) into
#                             $OUT/host_parts.json
#        | sweep              the dispatch / combine tuning variants and the notify trace (dev/profile_sweep.py) into
#                             $OUT/sweep.json; a variant whose outputs differ from the default's fails the step
#        | kernels            each call's kernels' GPU time at world size 1 (dev/profile_kernels.py) into
#                             $OUT/kernel_time.json
#        | copy               the copy probes' rates at 4-32 SMs (dev/profile_copy.py) into $OUT/copy.json
#        | compiled           a dispatch + combine step compiled with inductor against eager (dev/profile_compiled.py)
#                             into $OUT/compiled.json
#        | autograd           the eager differentiable calls against the Buffer's (dev/profile_autograd.py), and
#                             against deepcomm/eager_ops.py at $AUTOGRAD_REV if set, into $OUT/autograd.json
#                             (each profiler step takes $PROFILE_ARGS after its own arguments)
#        | 1:FILE,FILE        tests/*/FILE.py at world size 1 (one rank on the GPU)
#        | N:FILE,FILE[:EXPR] the files with N ranks sharing GPU 0 under MPS (docs/testing.md), pytest -k EXPR
#        | deepep             build DeepEP V1 from $DEEPEP_SRC (a copy carried into the tree) so that the benchmark
#                             times it beside deepcomm (PYTHONPATH for the later steps)
#        | bench              python -m deepcomm.bench over every GPU (one rank each) with $BENCH_ARGS into
#                             $OUT/bench.json
#        | soak               python -m deepcomm.soak --backend cuda --progress in this process (one rank) with
#                             $SOAK_ARGS (default --seconds 60) into $OUT/soak1.log; a run past the step's budget
#                             is stopped with SIGABRT, which makes Python dump every thread's traceback there;
#                             SOAK_BUDGET_S caps the step's seconds
#        | soak:N             the same with N ranks sharing GPU 0 under MPS (--world-size N) into $OUT/soakN.log
#        | soak:N@VAR=V,...   the same with these environment variables set for that step only (e.g.
#                             soak:8@DEEPCOMM_ARENA_OUTPUTS=64), into $OUT/soakN_VAR_V_....log
# e.g. bash dev/device_matrix.sh profile 1:test_normal_world1 2:test_agreement_gpu,test_intranode 8:test_intranode
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export DEEPCOMM_TEST_FAILURES_AT_ONCE=1
T0=$(date +%s)
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
summary="$OUT/summary.txt"
left() { echo $(( T0 + ${MATRIX_BUDGET_S:-540} - $(date +%s) )); }
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > "$summary" 2>&1
if ! timeout 300 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
rm -f "$OUT/build.log"
echo "build: $(( $(date +%s) - T0 )) s" | tee -a "$summary"

for step in "$@"; do
  budget=$(( $(left) - 5 ))
  if (( budget < 20 )); then echo "step $step: skipped, no time left" | tee -a "$summary"; continue; fi
  t0=$(date +%s)
  if [[ "$step" == deepep ]]; then
    (cd "${DEEPEP_SRC:?DEEPEP_SRC: the DeepEP V1 source folder}" && CPATH=/usr/local/cuda/include/cccl:${CPATH:-} \
      TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 timeout "$budget" python3 setup.py build_ext --inplace) \
      > "$OUT/deepep_build.log" 2>&1
    echo "deepep build: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$summary"
    export PYTHONPATH="$(cd "$DEEPEP_SRC" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
    tail -3 "$OUT/deepep_build.log"
    continue
  fi
  if [[ "$step" == soak || "$step" == soak:* || "$step" == soak@* ]]; then
    budget=$(( budget < ${SOAK_BUDGET_S:-$budget} ? budget : ${SOAK_BUDGET_S:-$budget} ))
    base="${step%%@*}"; step_env=(); tag=""
    if [[ "$step" == *@* ]]; then
      IFS=',' read -r -a step_env <<< "${step#*@}"
      tag="_$(printf %s "${step#*@}" | tr -c 'A-Za-z0-9_.-' '_')"
    fi
    ranks=1; [[ "$base" == soak:* ]] && ranks="${base#soak:}"
    log="$OUT/soak$ranks$tag.log"
    if (( ranks == 1 )); then
      # shellcheck disable=SC2086
      env "${step_env[@]}" RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=${SOAK_PORT:-29561} \
        timeout -s ABRT "$budget" python3 -X faulthandler -m deepcomm.soak --backend cuda --progress \
        ${SOAK_ARGS:---seconds 60} > "$log" 2>&1
    else
      # shellcheck disable=SC2086
      env "${step_env[@]}" timeout "$budget" bash launch/with_mps.sh python3 -m deepcomm.soak --world-size "$ranks" \
        --progress \
        ${SOAK_ARGS:---seconds 60} > "$log" 2>&1
    fi
    echo "$step: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$summary"
    grep -v "^iteration " "$log" | tail -25
    grep "^iteration " "$log" | tail -3
    continue
  fi
  if [[ "$step" == bench ]]; then
    gpus=$(nvidia-smi -L | wc -l)
    # shellcheck disable=SC2086
    timeout "$budget" torchrun --nproc-per-node "$gpus" -m deepcomm.bench --no-progress ${BENCH_ARGS:-} \
      --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
    echo "bench ($gpus GPUs): rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$summary"
    tail -40 "$OUT/bench.log"
    continue
  fi
  # the profilers: STEP -> "script | result name | extra arguments | lines of the log shown"
  profiler=""
  case "$step" in
    profile) profiler="profile_host.py|host_time|--cprofile $OUT/cprofile.txt|13" ;;
    parts)   profiler="profile_host_parts.py|host_parts||32" ;;
    sweep)   profiler="profile_sweep.py|sweep||40" ;;  # a variant whose outputs differ fails the step
    kernels) profiler="profile_kernels.py|kernel_time||30" ;;
    copy)    profiler="profile_copy.py|copy||20" ;;
    compiled) profiler="profile_compiled.py|compiled||10" ;;
    autograd) profiler="profile_autograd.py|autograd|${AUTOGRAD_REV:+--rev $AUTOGRAD_REV}|12" ;;
  esac
  if [[ -n "$profiler" ]]; then
    IFS='|' read -r script name extra shown <<< "$profiler"
    # shellcheck disable=SC2086
    timeout "$budget" python3 "dev/$script" --json "$OUT/$name.json" $extra ${PROFILE_ARGS:-} > "$OUT/$name.log" 2>&1
    echo "$step: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$summary"
    tail -"$shown" "$OUT/$name.log"
    continue
  fi
  world="${step%%:*}"; rest="${step#*:}"; files="${rest%%:*}"; expr=""
  [[ "$rest" == *:* ]] && expr="${rest#*:}"
  paths=()
  for f in ${files//,/ }; do paths+=(tests/*/"$f".py); done  # test file names are unique across subjects
  log="$OUT/tests_w$world.log"
  if [[ "$world" == 1 ]]; then
    env -u DEEPCOMM_TEST_SHARED_GPU -u DEEPCOMM_TEST_WORLD timeout "$budget" python3 -m pytest -v -ra -m gpu --durations=8 \
      -p no:cacheprovider ${expr:+-k "$expr"} "${paths[@]}" >> "$log" 2>&1
  else
    DEEPCOMM_TEST_SHARED_GPU=1 DEEPCOMM_TEST_WORLD="$world" timeout "$budget" bash launch/with_mps.sh \
      python3 -m pytest -v -ra -m gpu --durations=8 -p no:cacheprovider ${expr:+-k "$expr"} "${paths[@]}" >> "$log" 2>&1
  fi
  echo "$step: rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$summary"
  grep -E "(PASSED|FAILED|SKIPPED|ERROR)( |$)|passed|failed|s call " "$log" | grep -v "^E " | tail -30
done
