"""A collective call the backend cannot run inside CUDA graph capture (Capabilities.capturable) raises RuntimeError in
Buffer before it is numbered or joins any exchange, so every rank of the capture raises alike and the Buffer goes
on. On the CPU, 2 gloo ranks of the reference backend (which captures no call), with the capture state and the
device type stood in for."""
import pytest
import torch

from tests.helpers.multiproc import run_ranks


def _worker(rank, world):
    import deepcomm
    from deepcomm import validation
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=256, backend="reference")
    x = torch.randn(4, 256).to(torch.bfloat16)
    idx = torch.tensor([[0, 3], [1, -1], [2, 3], [-1, -1]])
    calls = buf._calls
    capturing, buf._device = validation.is_capturing, torch.device("cuda", 0)  # as if on a GPU, capturing
    validation.is_capturing = lambda: True
    said = []
    try:
        for call in (lambda: buf.dispatch(x, topk_idx=idx, num_experts=4),
                     lambda: buf.low_latency_dispatch(x, idx, 4, 4)):
            with pytest.raises(RuntimeError) as e:
                call()
            said.append(str(e.value))
    finally:
        validation.is_capturing, buf._device = capturing, torch.device("cpu")
    assert buf._calls == calls, "a refused call must not be numbered"
    # the Buffer goes on: the next agreeing calls on every rank (none of them paired with a refused one)
    recv_x, _, _, _, handle = buf.dispatch(x, topk_idx=idx, num_experts=4)
    out, _ = buf.combine(recv_x, handle)
    buf.destroy()
    return said, tuple(out.shape)


def test_a_call_the_backend_cannot_capture_raises_on_every_rank_and_the_buffer_goes_on():
    for said, shape in run_ranks(_worker, 2):
        assert shape == (4, 256)
        assert said[0].startswith("deepcomm: dispatch cannot be captured in a CUDA graph on this Buffer's backend "
                                  "(reference: it waits on the host")
        assert "it captures no call" in said[0] and said[1].startswith("deepcomm: low_latency_dispatch cannot")


def test_backends_say_what_they_capture():
    from deepcomm.backend_protocol import Capabilities
    from deepcomm.reference.backend import ReferenceBackend
    assert ReferenceBackend.capabilities.capturable == frozenset()
    assert Capabilities(x_dtypes=(), takes_fingerprints=False, checks_expert_ids_on_device=False,
                        checks_low_latency_ids_on_device=False).capturable == frozenset()
    pytest.importorskip("deepcomm._C")
    from deepcomm.internode.backend import InternodeBackend
    from deepcomm.nvlink.backend import CudaBackend
    everything = {"dispatch", "combine", "low_latency_dispatch", "low_latency_combine"}
    assert CudaBackend.capabilities.capturable == everything
    assert InternodeBackend.capabilities.capturable == {"low_latency_dispatch", "low_latency_combine"}
