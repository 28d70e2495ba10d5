"""The backend choice says why it is what it is: backend="auto" warns (once per reason) when it falls back to the
reference backend where the CUDA kernels could have run, backend="cuda" raises with the reason, and a Buffer's
creation is logged on rank 0 through the "deepcomm" logger (DEEPCOMM_LOG)."""
import logging
import warnings

import pytest

from deepcomm import backends, log
from deepcomm.config import Config
from multiproc import run_ranks


@pytest.fixture
def gpu_box(monkeypatch):
    """A machine where the CUDA backend could run (CUDA present, an NCCL group) but for what a test refuses."""
    monkeypatch.setattr(backends.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "group_uses_nccl", lambda group, requested="cuda": True)
    monkeypatch.setattr(backends, "_warned", set())
    return monkeypatch


def test_auto_warns_once_per_reason_when_the_extension_is_missing(gpu_box):
    gpu_box.setattr(backends, "cuda_unavailable_reason", lambda group, requested="cuda": "the extension deepcomm._C is not available")
    with pytest.warns(RuntimeWarning, match="reference backend .* because the extension deepcomm._C is not avail"):
        choice = backends.choose_backend("auto", None, Config(gpus_per_node=2), 2)
        backends.warn_if_fallback(choice, rank=0)
    assert (choice.name, choice.faster_possible, choice.internode) == ("reference", True, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backends.warn_if_fallback(choice, rank=0)  # the same reason again: silent
        backends.warn_if_fallback(backends.BackendChoice("auto", "reference", False, "other", True), rank=1)


def test_auto_warns_when_the_internode_backend_is_refused(gpu_box):
    gpu_box.setattr(backends, "cuda_unavailable_reason", lambda group, requested="cuda": None)
    gpu_box.setattr(backends, "internode_unavailable_reason",
                    lambda group, world, transport, g: f"the ranks span several hosts ({transport})")
    choice = backends.choose_backend("auto", None, Config(gpus_per_node=1), 2)
    assert choice.name == "reference" and choice.internode
    assert choice.refused == "the internode CUDA backend cannot run: the ranks span several hosts (emulated)"
    with pytest.warns(RuntimeWarning, match="internode CUDA backend cannot run: the ranks span several hosts"):
        backends.warn_if_fallback(choice, rank=0)
    with pytest.raises(RuntimeError, match="backend='cuda' cannot run here: the internode CUDA backend cannot run"):
        backends.choose_backend("cuda", None, Config(gpus_per_node=1), 2)


def test_no_warning_where_no_cuda_backend_could_run(monkeypatch):
    monkeypatch.setattr(backends.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.setattr(backends, "cuda_unavailable_reason", lambda group, requested="cuda": "CUDA is not available")
    choice = backends.choose_backend("auto", None, Config(gpus_per_node=2), 2)
    assert (choice.name, choice.refused, choice.faster_possible) == ("reference", "CUDA is not available", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backends.warn_if_fallback(choice, rank=0)
    assert backends.choose_backend("reference", None, Config(), 2).refused is None
    with pytest.raises(ValueError, match="^backend:"):
        backends.choose_backend("fast", None, Config(), 2)


def test_log_level_from_the_environment(monkeypatch):
    monkeypatch.setenv("DEEPCOMM_LOG", " Debug ")
    log.configure_from_env()
    log.configure_from_env()
    assert log.logger.level == logging.DEBUG
    assert sum(h is log._handler for h in log.logger.handlers) == 1
    monkeypatch.setenv("DEEPCOMM_LOG", "loud")
    with pytest.raises(ValueError, match="^DEEPCOMM_LOG: expected one of debug, info"):
        log.configure_from_env()
    log.logger.setLevel(logging.NOTSET)


def _logged_creation(rank, world):
    import io
    import deepcomm
    from deepcomm import log as dlog
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    dlog.logger.addHandler(handler)
    dlog.logger.setLevel(logging.INFO)
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=128, backend="auto", num_sms=8)
    buf.destroy()
    return stream.getvalue()


def test_buffer_creation_is_logged_on_rank_0():
    out = run_ranks(_logged_creation, 2)
    assert out[1] == ""
    text = out[0]
    for part in ("Buffer ", "backend 'reference' (pure PyTorch), requested 'auto', 2 ranks",
                 "transport: torch.distributed collectives (gloo)", "topology: 1 node(s) x 2 GPU(s)",
                 "num_sms: 8", "max_tokens_per_rank 16, hidden 128", "not the CUDA kernels: "):
        assert part in text, text
