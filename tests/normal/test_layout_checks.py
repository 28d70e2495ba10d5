"""Who range-checks get_dispatch_layout's expert ids (deepcomm/backend_protocol.py checks_layout_ids_on_device):
the reference and internode backends through Buffer on the host, at once; the CUDA backend in its kernel, without a
host sync, raising at the next call on the Buffer or synchronize() (its GPU side: tests/normal/test_layout_gpu.py).
On CPU: the capabilities, Buffer's check, and the CUDA backend's raising of a recorded layout error."""
import dataclasses

import pytest
import torch

from deepcomm.backend_protocol import Capabilities
from deepcomm.nvlink.backend import CudaBackend
from deepcomm.cuda.call_errors import CallErrors
from deepcomm.internode.backend import InternodeBackend
from deepcomm.reference.backend import ReferenceBackend
from tests.errors.test_deferred_errors import FakeRecord, S, _nvl
from tests.helpers.multiproc import run_ranks


def test_only_the_cuda_backend_checks_layout_ids_on_its_device():
    assert CudaBackend.capabilities.checks_layout_ids_on_device is True
    assert ReferenceBackend.capabilities.checks_layout_ids_on_device is False
    assert InternodeBackend.capabilities.checks_layout_ids_on_device is False
    fields = {f.name: f for f in dataclasses.fields(Capabilities)}
    assert fields["checks_layout_ids_on_device"].default is False  # a backend that does not say checks nothing


def _buffer_worker(rank, world):
    import deepcomm
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=256)
    bad = torch.tensor([[0, 8], [-2, 1]])
    seen = {}
    for name, idx in (("too_large", bad[:1]), ("below_minus_one", bad[1:])):
        try:
            buf.get_dispatch_layout(idx, 8)
            seen[name] = "no error"
        except ValueError as exc:
            seen[name] = str(exc)
    # a backend that checks on its device: Buffer leaves the values to it and keeps the host checks of the rest
    backend = buf._live()
    backend.capabilities = dataclasses.replace(backend.capabilities, checks_layout_ids_on_device=True)
    passed = []
    backend.get_dispatch_layout = lambda idx, e: passed.append((idx.tolist(), e)) or "from the backend"
    seen["device_checked"] = buf.get_dispatch_layout(bad, 8)
    seen["passed"] = passed
    for name, call in (("dtype", lambda: buf.get_dispatch_layout(bad.int(), 8)),
                       ("num_experts", lambda: buf.get_dispatch_layout(bad, 7 if world > 1 else 0))):
        try:
            call()
            seen[name] = "no error"
        except ValueError as exc:
            seen[name] = str(exc)
    return seen


def test_buffer_checks_values_on_the_host_unless_the_backend_checks_them():
    seen = run_ranks(_buffer_worker, 1)[0]
    assert seen["too_large"].startswith("topk_idx: expert ids must be < num_experts=8"), seen["too_large"]
    assert seen["below_minus_one"].startswith("topk_idx: expert ids must be >= -1"), seen["below_minus_one"]
    assert seen["device_checked"] == "from the backend"
    assert seen["passed"] == [([[0, 8], [-2, 1]], 8)]
    assert seen["dtype"].startswith("topk_idx:"), seen["dtype"]
    assert seen["num_experts"].startswith("num_experts:"), seen["num_experts"]


class _Ctx:
    """NvlContext's layout crossing, recorded instead of launched."""

    def __init__(self):
        self.launches = []

    def dispatch_layout(self, *args):
        self.launches.append(args)


def _cuda_backend_over(record, monkeypatch):
    """A CudaBackend with only its error state and a recording context (no device)."""
    import deepcomm.nvlink.backend as cuda_backend
    monkeypatch.setattr(cuda_backend, "_current_stream", lambda index: 0)
    b = CudaBackend.__new__(CudaBackend)
    b.nvl = _nvl(record)
    b.nvl.ctx = _Ctx()
    b.errors = CallErrors(b.nvl)
    b.world_size, b.device, b._device_index = 2, torch.device("cpu"), 0
    return b


def test_recorded_layout_error_raises_at_the_next_call_after_it_ran(monkeypatch):
    rec = FakeRecord()
    rec.record = (1, 3, 3, S["layout_invalid_ids"], 0, 7)  # rank 3's kernel found 7 bad ids
    b = _cuda_backend_over(rec, monkeypatch)
    with pytest.raises(ValueError, match=r"^topk_idx: an earlier get_dispatch_layout on rank 3 had 7 expert ids "
                                         r"outside \[-1, num_experts\); they counted nowhere"):
        b.get_dispatch_layout(torch.zeros(5, 2, dtype=torch.int64), 4)
    assert len(b.nvl.ctx.launches) == 1  # the call itself ran first, as every call does
    _, T, K, E = b.nvl.ctx.launches[0][:4]
    assert (T, K, E) == (5, 2, 4)
    assert rec.record[0] == 0  # cleared: raised once
    per_rank, per_expert, in_rank = b.get_dispatch_layout(torch.zeros(5, 2, dtype=torch.int64), 4)
    assert per_rank.shape == (2,) and per_expert.shape == (4,) and in_rank.shape == (5, 2)
    assert (per_rank.dtype, per_expert.dtype, in_rank.dtype) == (torch.int32, torch.int32, torch.bool)


def test_recorded_layout_error_is_held_through_a_collective_call():
    rec = FakeRecord()
    rec.record = (1, 0, 0, S["layout_invalid_ids"], 0, 2)
    errors = CallErrors(_nvl(rec))
    errors.check()  # a collective call holds it while it joins the others
    assert rec.record[0] == 0
    with pytest.raises(ValueError, match=r"get_dispatch_layout on rank 0 had 2 expert ids"):
        errors.raise_pending()


def test_layout_stage_is_an_input_error_with_a_stable_number():
    from deepcomm._ext import load_extension
    from deepcomm.cuda.wait_stages import input_error_text
    C = load_extension()
    if C is None:
        pytest.skip("the CUDA extension is not built")
    assert C.WAIT_STAGES["layout_invalid_ids"] == 105  # csrc/runtime/error_record.cuh
    assert "{count}" in input_error_text(C, 105)
