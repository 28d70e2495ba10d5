"""On GPUs: Buffer creation logs the CUDA backend and its transport without a fallback warning, and
`python -m deepcomm` reports the GPUs, their peer access and the CUDA backend as available."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers.nccl_run import gpu_count, run_on_gpus
from tests.helpers.paths import ROOT

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs with peer access")]


def _logged_cuda_buffer(rank, world):
    import io
    import logging
    import warnings

    import deepcomm
    from deepcomm import log

    stream = io.StringIO()
    log.logger.addHandler(logging.StreamHandler(stream))
    log.logger.setLevel(logging.INFO)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback warning where the kernels run
        buf = deepcomm.Buffer(max_tokens_per_rank=64, hidden=256, backend="auto")
    assert buf.backend_name == "cuda", buf.backend_name
    text = stream.getvalue()
    if rank == 0:
        for part in ("backend 'cuda' (CUDA kernels, NVLink)", "transport: NVLink peer memory (CUDA IPC)",
                     f"topology: 1 node(s) x {world} GPU(s)", f"num_sms: {buf.num_sms};",
                     "max_tokens_per_rank 64, hidden 256"):
            assert part in text, text
        assert "not the CUDA kernels" not in text, text
    else:
        assert text == "", text
    buf.destroy()


def test_buffer_logs_the_cuda_backend():
    run_on_gpus(_logged_cuda_buffer, 2)


def test_python_m_deepcomm_on_gpus():
    out = subprocess.run([sys.executable, "-m", "deepcomm"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"GPUs: {gpu_count()}" in text and "peer access" in text and "  cuda:0 " in text, text
    assert "  cuda: available with an NCCL process group" in text, text
    assert "built for: sm_" in text, text
