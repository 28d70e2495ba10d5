#!/usr/bin/env bash
# Run a command with the CUDA MPS control daemon up, so that several processes share one GPU's SMs at once (ranks
# sharing a GPU: docs/testing.md); the daemon is stopped afterwards, whatever the command's outcome.
#   bash launch/with_mps.sh CMD [ARGS...]        exit status: CMD's
# The daemon is a user-level one: its pipe and log directories (CUDA_MPS_PIPE_DIRECTORY, CUDA_MPS_LOG_DIRECTORY)
# are under a fresh temporary directory, exported to CMD so its CUDA processes connect to it. Nothing about the
# GPU is changed (no compute mode, no clocks): where the daemon cannot start (no nvidia-cuda-mps-control, or it
# fails), CMD runs without MPS, the processes then sharing the GPU by time slicing (correct, much slower).
set -uo pipefail
[[ $# -gt 0 ]] || { echo "usage: bash launch/with_mps.sh CMD [ARGS...]" >&2; exit 2; }

mps_dir="$(mktemp -d "${TMPDIR:-/tmp}/deepcomm-mps.XXXXXX")"
export CUDA_MPS_PIPE_DIRECTORY="$mps_dir/pipe" CUDA_MPS_LOG_DIRECTORY="$mps_dir/log"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
started=0

stop_mps() {
  if [[ $started == 1 ]]; then
    echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
    # the daemon leaves once its server has no clients; give it a moment, then leave its files behind if not
    for _ in $(seq 50); do pgrep -u "$(id -u)" -f "nvidia-cuda-mps-control -d" >/dev/null || break; sleep 0.1; done
  fi
  rm -rf "$mps_dir"
}
trap stop_mps EXIT

if command -v nvidia-cuda-mps-control >/dev/null 2>&1 && nvidia-cuda-mps-control -d; then
  started=1
  echo "[with_mps] MPS control daemon started (pipes in $CUDA_MPS_PIPE_DIRECTORY)" >&2
else
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  echo "[with_mps] MPS is not available here: running without it (time slicing)" >&2
fi
"$@"
rc=$?
if [[ $started == 1 && -f "$mps_dir/log/control.log" ]]; then
  # the daemon's own word on failures (a client fault takes the server down for every client)
  grep -i "error\|fault\|fail" "$mps_dir/log/control.log" "$mps_dir/log/server.log" 2>/dev/null | tail -5 >&2
fi
exit $rc
