#!/usr/bin/env bash
# compute-sanitizer on the intranode kernels (normal and low-latency mode) at small sizes on 2 GPUs: one process
# per GPU (dev/sanitize_driver.py), each under its own compute-sanitizer, for each tool in turn.
#   bash dev/sanitize.sh            # tools: memcheck racecheck synccheck (SANITIZE_TOOLS to choose)
# Writes $OUT/sanitize.log (every tool's output, both ranks) and appends one pass/fail line per tool to
# $OUT/summary.txt. Exit status 0 only when every tool passed on both ranks.
# Only deepcomm's kernels are instrumented (--kernel-name kns=dc: the dc namespace; NCCL's and torch's are not).
# memcheck: out-of-bounds / misaligned accesses; racecheck: shared-memory hazards within a block; synccheck:
# invalid barrier use. The kernels spin on flags written by the peer GPU, which the sanitizer slows down a lot, so
# the driver raises deepcomm's wait timeout; every step is bounded by `timeout` and then killed as a group.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# few blocks keep the sanitized runs short (read by low-latency kernels that otherwise take one block per SM)
export DEEPCOMM_LL_NUM_SMS="${DEEPCOMM_LL_NUM_SMS:-8}"
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
SAN="${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}"
TOOLS="${SANITIZE_TOOLS:-memcheck racecheck synccheck}"
STEP_TIMEOUT="${SANITIZE_STEP_TIMEOUT:-150}"   # seconds per tool (both ranks run at once)
DC_TIMEOUT="${SANITIZE_DC_TIMEOUT:-100}"        # deepcomm wait timeout inside the driver, below STEP_TIMEOUT
log="$OUT/sanitize.log"
summary="$OUT/summary.txt"
: > "$log"
if [[ ! -x "$SAN" ]]; then
  echo "sanitize: FAIL (no compute-sanitizer at $SAN)" | tee -a "$summary" "$log"
  exit 1
fi
"$SAN" --version 2>&1 | tail -1 >> "$log"
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

all_ok=0
for tool in $TOOLS; do
  t0=$(date +%s)
  port=$(free_port)
  pids=()
  for rank in 0 1; do
    # setsid: each rank leads its own process group, so a timed-out step can be killed whole (sanitizer + python)
    RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      setsid -w timeout -k 10 "$STEP_TIMEOUT" "$SAN" --tool "$tool" --kernel-name kns=dc --error-exitcode 86 --report-api-errors no \
        --print-limit 30 python3 dev/sanitize_driver.py --timeout-s "$DC_TIMEOUT" \
        > "$OUT/.sanitize_${tool}_${rank}.tmp" 2>&1 &
    pids+=($!)
  done
  verdict=pass
  for rank in 0 1; do
    wait "${pids[$rank]}"
    rc=$?
    kill -KILL -- "-${pids[$rank]}" 2>/dev/null  # leftovers of a timed-out step
    tmp="$OUT/.sanitize_${tool}_${rank}.tmp"
    {
      echo "===== $tool rank $rank: exit $rc (124/137: timed out; 86: the sanitizer found errors)"
      tail -n 150 "$tmp"
    } >> "$log"
    if [[ $rc -ne 0 ]] || ! grep -q "sanitize driver rank $rank: ok" "$tmp"; then verdict=FAIL; fi
    found=$(grep -h "SUMMARY" "$tmp" | tr -s ' =' ' ' | head -2 | paste -sd ';' -)
    echo "  $tool rank $rank: exit $rc ${found:-no sanitizer summary}" >> "$summary"
    rm -f "$tmp"
  done
  [[ $verdict == pass ]] || all_ok=1
  echo "sanitize $tool: $verdict $(( $(date +%s) - t0 )) s" | tee -a "$summary" "$log"
done
exit $all_ok
