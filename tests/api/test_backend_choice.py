"""The backend choice says why it is what it is: backend="auto" warns (once per reason) when it falls back to the
reference backend where the CUDA kernels could have run, backend="cuda" raises with the reason, and a Buffer's
creation is logged on rank 0 through the "deepcomm" logger (DEEPCOMM_LOG)."""
import logging
import warnings

import pytest

from deepcomm import backends, log
from deepcomm.config import Config
from tests.helpers.multiproc import run_ranks


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
                    lambda group, world, transport, g, hosts=None: f"the ranks span several hosts ({transport})")
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


# ---- ranks on several hosts ----

def _two_hosts(monkeypatch, nodes=2, gpus=8, cuda=True, nvshmem=None):
    """A group of nodes x gpus ranks, node by node on hosts h0, h1, ...; CUDA (an NCCL group) there or not;
    ``nvshmem``: why NVSHMEM would not load (None: it loads)."""
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.setattr(backends.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(backends, "group_uses_nccl", lambda group: cuda)
    monkeypatch.setattr(backends, "cuda_unavailable_reason",
                        lambda group, requested="cuda": None if cuda else "CUDA is not available")
    monkeypatch.setattr(backends, "group_hosts", lambda group, world: [f"h{r // gpus}" for r in range(world)])
    monkeypatch.setattr(backends, "hosts_of", lambda group: pytest.fail("the host names are gathered once"))
    monkeypatch.setattr(backends, "nvshmem_unavailable_reason", lambda transport="nvshmem": nvshmem)
    return nodes * gpus


def _warned_once(choice, match):
    with pytest.warns(RuntimeWarning, match=match):
        backends.warn_if_fallback(choice, rank=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backends.warn_if_fallback(choice, rank=0)  # the same reason again: silent


@pytest.mark.skipif(backends.load_extension() is None, reason="deepcomm._C is not built")
def test_several_hosts_take_the_internode_backend_over_nvshmem(monkeypatch):
    world = _two_hosts(monkeypatch)
    for requested in ("auto", "cuda"):
        config = Config(gpus_per_node=8)
        assert config.internode_transport == "emulated" and not config.internode_transport_chosen
        choice = backends.choose_backend(requested, None, config, world)
        assert (choice.name, choice.internode, choice.transport, choice.refused) == ("cuda", True, "nvshmem", None)
    # on one host the default stays the emulated NIC
    monkeypatch.setattr(backends, "group_hosts", lambda group, world: ["h0"] * world)
    choice = backends.choose_backend("auto", None, Config(gpus_per_node=8), world)
    assert (choice.name, choice.transport) == ("cuda", "emulated")


@pytest.mark.skipif(backends.load_extension() is None, reason="deepcomm._C is not built")
def test_make_backend_builds_the_transport_it_chose(monkeypatch):
    import deepcomm.internode.backend as internode
    world = _two_hosts(monkeypatch)
    built = []
    monkeypatch.setattr(internode, "InternodeBackend", lambda group, config, *rest: built.append(config) or "ib")
    config = Config(gpus_per_node=8)
    backend, choice = backends.make_backend("auto", None, config, 0, world, None)
    assert backend == "ib" and built == [config] and config.internode_transport == "nvshmem"


@pytest.mark.skipif(backends.load_extension() is None, reason="deepcomm._C is not built")
def test_several_hosts_without_nvshmem_warn_or_raise(monkeypatch):
    world = _two_hosts(monkeypatch, nvshmem="NVSHMEM is not available (NVSHMEM not found: libnvshmem_host.so.3)")
    choice = backends.choose_backend("auto", None, Config(gpus_per_node=8), world)
    assert (choice.name, choice.faster_possible, choice.transport) == ("reference", True, None)
    _warned_once(choice, "reference backend .* because the internode CUDA backend cannot run: NVSHMEM is not avail")
    with pytest.raises(RuntimeError, match="backend='cuda' cannot run here: .*NVSHMEM not found"):
        backends.choose_backend("cuda", None, Config(gpus_per_node=8), world)


def test_several_hosts_without_a_gpu_warn_or_raise(monkeypatch):
    world = _two_hosts(monkeypatch, cuda=False)
    choice = backends.choose_backend("auto", None, Config(gpus_per_node=8), world)
    assert (choice.name, choice.refused, choice.faster_possible) == ("reference", "CUDA is not available", True)
    _warned_once(choice, "because CUDA is not available")
    with pytest.raises(RuntimeError, match="backend='cuda' cannot run here: CUDA is not available"):
        backends.choose_backend("cuda", None, Config(gpus_per_node=8), world)
    # one host without a GPU: the reference backend is all there is, nothing to warn about
    monkeypatch.setattr(backends, "group_hosts", lambda group, world: ["h0"] * world)
    choice = backends.choose_backend("auto", None, Config(gpus_per_node=8), world)
    assert choice.name == "reference" and not choice.faster_possible


@pytest.mark.skipif(backends.load_extension() is None, reason="deepcomm._C is not built")
def test_several_hosts_with_too_many_ranks_or_nodes_warn_or_raise(monkeypatch):
    for nodes, gpus, why in ((33, 8, "at most 256 ranks, the group has 264"),
                             (33, 4, "at most 32 nodes, the topology has 33 \\(132 ranks, gpus_per_node=4\\)")):
        world = _two_hosts(monkeypatch, nodes, gpus)
        choice = backends.choose_backend("auto", None, Config(gpus_per_node=gpus), world)
        assert choice.name == "reference"
        _warned_once(choice, "internode CUDA backend cannot run: the internode path takes " + why)
        with pytest.raises(RuntimeError, match="backend='cuda' cannot run here: .*" + why):
            backends.choose_backend("cuda", None, Config(gpus_per_node=gpus), world)
    world = _two_hosts(monkeypatch, 32, 8)  # the largest topology fits
    assert backends.choose_backend("cuda", None, Config(gpus_per_node=8), world).transport == "nvshmem"


@pytest.mark.skipif(backends.load_extension() is None, reason="deepcomm._C is not built")
def test_several_hosts_keep_a_chosen_transport(monkeypatch):
    world = _two_hosts(monkeypatch)
    config = Config(gpus_per_node=8, internode_transport="emulated")
    assert config.internode_transport_chosen
    choice = backends.choose_backend("auto", None, config, world)
    assert choice.name == "reference"
    _warned_once(choice, "emulated NIC runs only on one host")
    monkeypatch.setenv("DEEPCOMM_INTERNODE_TRANSPORT", "emulated")  # chosen through the environment
    with pytest.raises(RuntimeError, match="emulated NIC runs only on one host"):
        backends.choose_backend("cuda", None, Config(gpus_per_node=8), world)


def test_several_hosts_posed_as_one_node_are_refused(monkeypatch):
    world = _two_hosts(monkeypatch)
    choice = backends.choose_backend("auto", None, Config(), world)  # no gpus_per_node: one node of 16 ranks
    assert choice.name == "reference" and not choice.internode
    _warned_once(choice, "span several hosts but the topology is one node; set LOCAL_WORLD_SIZE")
    with pytest.raises(RuntimeError, match="topology is one node"):
        backends.choose_backend("cuda", None, Config(), world)


def test_nvshmem_reason_is_the_first_line_of_the_loader_error(monkeypatch):
    from deepcomm.cuda import nvshmem_library
    def missing():
        raise nvshmem_library.NvshmemUnavailableError("NVSHMEM not found: no libnvshmem_host.so.3\nTo fix: install")
    monkeypatch.setattr(nvshmem_library, "load_library", missing)
    assert backends.nvshmem_unavailable_reason() == "NVSHMEM is not available (NVSHMEM not found: no libnvshmem_host.so.3)"
    monkeypatch.setattr(nvshmem_library, "load_library", lambda: object())
    assert backends.nvshmem_unavailable_reason() is None
