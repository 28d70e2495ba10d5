#!/usr/bin/env bash
# The test entry point: set up if needed, then pytest.
#   always:        the CPU tests (tests/ without the `gpu` marker)
#   with GPU(s):   the GPU tests too (marked `gpu`; each skips by GPU count)
# Arguments go to pytest. Exit status is pytest's (5 = no test collected).
set -euo pipefail
# shellcheck source=launch/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
deepcomm_setup
cd "$DEEPCOMM_ROOT"

gpus="$(deepcomm_gpu_count)"
if [[ "$gpus" -gt 0 ]]; then
    echo "[deepcomm test] $gpus GPU(s): CPU and GPU tests" >&2
    exec "$DEEPCOMM_PY" -m pytest -ra tests "$@"
fi
echo "[deepcomm test] no GPU: CPU tests (-m 'not gpu')" >&2
exec "$DEEPCOMM_PY" -m pytest -ra -m "not gpu" tests "$@"
