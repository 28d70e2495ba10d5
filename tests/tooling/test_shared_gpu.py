"""Several ranks on one GPU, the pure-Python side: the test runner's shared mode (tests/helpers/nccl_run.py), each rank's
SM share (deepcomm/gpu_share.py), local_launch's ranks per GPU, the device and backend a gloo group's Buffer gets
(deepcomm/backends.py), the reference oracle's DeviceAdapter, and the benchmark's shared-GPU detection."""
import os

import pytest
import torch

from deepcomm import gpu_share
from deepcomm.bench import shared_gpu
from deepcomm.handle import Handle, LowLatencyHandle
from deepcomm.local_launch import ranks_per_gpu
from deepcomm.reference.device_adapter import DeviceAdapter, move
from tests.helpers import nccl_run
from tests.helpers.multiproc import run_ranks


# ---- the runner's shared mode ----
@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(nccl_run, "gpu_count", lambda: 1)
    monkeypatch.delenv("DEEPCOMM_TEST_SHARED_GPU", raising=False)
    monkeypatch.delenv("DEEPCOMM_TEST_WORLD", raising=False)
    return monkeypatch


def test_without_shared_mode_one_gpu_runs_nothing_of_two_ranks(one_gpu):
    assert not nccl_run.shared_gpu()
    assert not nccl_run.can_run(2) and nccl_run.can_run(1)
    one_gpu.setenv("DEEPCOMM_TEST_WORLD", "8")
    assert nccl_run.ranks_for_tests() == 2  # capped by the GPUs (and never below 2)
    assert nccl_run.rank_device(1) == torch.device("cuda", 1)
    assert nccl_run.scaled(100.0) == 100.0


def test_shared_mode_puts_every_rank_on_gpu_0(one_gpu):
    one_gpu.setenv("DEEPCOMM_TEST_SHARED_GPU", "1")
    one_gpu.setenv("DEEPCOMM_TEST_WORLD", "8")
    assert nccl_run.shared_gpu() and nccl_run.ranks_for_tests() == 8
    assert nccl_run.can_run(2) and nccl_run.can_run(4) and nccl_run.can_run(8) and not nccl_run.can_run(16)
    assert nccl_run.rank_device(5) == torch.device("cuda", 0)
    assert nccl_run.scaled(100.0) == 400.0
    one_gpu.setenv("DEEPCOMM_TEST_WORLD", "2")  # a shared run at 2 ranks leaves the 8-rank topologies out
    assert nccl_run.can_run(2) and not nccl_run.can_run(4)
    one_gpu.setenv("DEEPCOMM_TEST_SHARED_GPU", "0")
    assert not nccl_run.shared_gpu()


def test_shared_mode_needs_a_gpu(one_gpu):
    one_gpu.setattr(nccl_run, "gpu_count", lambda: 0)
    one_gpu.setenv("DEEPCOMM_TEST_SHARED_GPU", "1")
    assert not nccl_run.can_run(2)


@pytest.mark.parametrize("bad", ["1", "x", "-4"])
def test_bad_test_world_names_the_variable(one_gpu, bad):
    one_gpu.setenv("DEEPCOMM_TEST_WORLD", bad)
    with pytest.raises(ValueError, match="DEEPCOMM_TEST_WORLD"):
        nccl_run.ranks_for_tests()


def test_needs_ranks_skips_with_the_reason(one_gpu):
    mark = nccl_run.needs_ranks(8, "2 nodes x 4 GPUs")
    assert mark.args[0] is True and "2 nodes x 4 GPUs needs 8 GPUs" in mark.kwargs["reason"]
    assert "DEEPCOMM_TEST_SHARED_GPU=1" in mark.kwargs["reason"]


@pytest.mark.parametrize("world, share", [(2, 66), (4, 33), (8, 16)])
def test_shared_sms_fit_every_rank_on_132_sms(world, share):
    assert nccl_run.shared_sms(world, 132) == share and world * share <= 132


# ---- SM shares ----
def test_sms_per_rank():
    assert gpu_share.sms_per_rank(132, 1) == 132 and gpu_share.sms_per_rank(132, 8) == 16
    assert gpu_share.sms_per_rank(4, 8) == 1
    with pytest.raises(ValueError, match="ranks_on_gpu"):
        gpu_share.sms_per_rank(132, 0)


def test_sm_budget_from_the_environment(monkeypatch):
    monkeypatch.delenv(gpu_share.GPU_SMS_ENV, raising=False)
    assert gpu_share.sm_budget(132) == 132
    monkeypatch.setenv(gpu_share.GPU_SMS_ENV, "33")
    assert gpu_share.sm_budget(132) == 33
    monkeypatch.setenv(gpu_share.GPU_SMS_ENV, "500")
    assert gpu_share.sm_budget(132) == 132  # never more than the GPU has
    for bad in ("0", "many", "-3"):
        monkeypatch.setenv(gpu_share.GPU_SMS_ENV, bad)
        with pytest.raises(ValueError, match=gpu_share.GPU_SMS_ENV):
            gpu_share.sm_budget(132)


def test_most_ranks_on_one_gpu():
    assert gpu_share.most_ranks_on_one_gpu([]) == 0
    assert gpu_share.most_ranks_on_one_gpu(["h/a", "h/b"]) == 1
    assert gpu_share.most_ranks_on_one_gpu(["h/a", "h/a", "h/b", "h/a"]) == 3
    assert gpu_share.most_ranks_on_one_gpu(["h1/a", "h2/a"]) == 1  # same UUID text, other host


def test_ranks_per_gpu(monkeypatch):
    monkeypatch.delenv("DEEPCOMM_SHARED_GPU", raising=False)
    assert ranks_per_gpu(2, 2) == 1 and ranks_per_gpu(8, 8) == 1
    assert ranks_per_gpu(4, 1) == 4 and ranks_per_gpu(8, 2) == 4 and ranks_per_gpu(5, 2) == 3
    monkeypatch.setenv("DEEPCOMM_SHARED_GPU", "1")
    assert ranks_per_gpu(2, 2) == 2  # forced: all on GPU 0
    with pytest.raises(ValueError, match="gpus"):
        ranks_per_gpu(2, 0)


# ---- the device and backend of a gloo group's Buffer ----
def _device_rule_worker(rank, world):
    import deepcomm.backends as b
    import torch.distributed as dist
    group = dist.group.WORLD
    assert not b.group_uses_nccl(group)
    cpu = torch.device("cpu")
    assert b.group_device(group) == cpu and b.group_device(group, "reference") == cpu
    # no CUDA in this process: backend="cuda" cannot take a device, so the gloo group stays on the CPU...
    assert b.group_device(group, "cuda") == cpu
    # ...where CUDA is there, "cuda" takes the current device and "auto" keeps the reference on the CPU
    torch.cuda.is_available, torch.cuda.current_device = (lambda: True), (lambda: 0)
    b.load_extension = lambda: object()
    assert b.group_device(group, "cuda") == torch.device("cuda", 0)
    assert b.group_device(group, "auto") == cpu
    assert b.cuda_unavailable_reason(group, "cuda") is None
    reason = b.cuda_unavailable_reason(group, "auto")
    assert "'gloo'" in reason and "backend='cuda'" in reason, reason
    return True


def test_gloo_group_device_and_backend_rule():
    assert run_ranks(_device_rule_worker, 1) == [True]


# ---- the oracle's adapter ----
def _handle(device):
    t = torch.zeros(3, 2, dtype=torch.int32, device=device)
    return Handle(buffer_id=7, num_experts=4, num_tokens=3, hidden=8, num_recv=2, is_token_in_rank=t.bool(),
                  send_pos=t, count_matrix=t[:2], recv_src_idx=t[0], num_recv_tokens_per_expert=[1, 1])


def test_move_reaches_tensors_in_tuples_lists_and_handles():
    meta = torch.device("meta")
    h = move(_handle("cpu"), meta)
    assert h.buffer_id == 7 and h.send_pos.device == meta and h.num_recv_tokens_per_expert == [1, 1]
    out = move((torch.ones(2), [torch.ones(1), 3], "x", None), meta)
    assert out[0].device == meta and out[1][0].device == meta and out[1][1] == 3 and out[2:] == ("x", None)
    ll = LowLatencyHandle(src_info=torch.zeros(1, 2), layout=torch.zeros(1, 1, 2), recv_pos=torch.zeros(2, 1),
                          num_experts=1, num_max_dispatch_tokens_per_rank=2, hidden=8, buffer_id=3, slot=1)
    moved = move(ll, meta)
    assert moved.recv_pos.device == meta and moved.slot == 1 and ll.recv_pos.device.type == "cpu"


class _CpuBuffer:
    """Records what a call got; answers with a tensor and a handle. Its device, "cpu:0", differs from "cpu" as a
    name (so the adapter converts) while both hold data here (a meta tensor has none to copy back)."""
    device = torch.device("cpu", 0)
    rank = 3

    def dispatch(self, x, handle=None, **kw):
        self.seen = (x.clone(), handle)
        return x + 1, _handle("cpu")


def test_adapter_moves_arguments_there_and_results_back(monkeypatch):
    buf = _CpuBuffer()
    ad = DeviceAdapter(buf, "cpu")
    assert ad.rank == 3  # attributes are the buffer's
    moves = []
    import deepcomm.reference.device_adapter as da
    real = da.move
    monkeypatch.setattr(da, "move", lambda v, d: moves.append(torch.device(d)) or real(v, d))
    h = _handle("cpu")
    y, out = ad.dispatch(torch.ones(2), handle=h)
    assert torch.equal(buf.seen[0], torch.ones(2)) and torch.equal(y, torch.full((2,), 2.0))
    assert buf.seen[1] is not h and buf.seen[1].buffer_id == 7  # the handle travelled as a moved copy
    # arguments to the buffer's device first, then the results to the caller's
    assert set(moves) == {torch.device("cpu", 0), torch.device("cpu")} and moves[-1] == torch.device("cpu"), moves
    with pytest.raises(ValueError, match="return_recv_hook"):
        ad.dispatch(torch.ones(2), return_recv_hook=True)
    same = DeviceAdapter(buf, torch.device("cpu", 0))
    assert same.dispatch == buf.dispatch  # one device: the buffer's own methods


# ---- the benchmark on a shared GPU ----
def test_bench_detects_shared_gpus():
    assert not shared_gpu.is_shared(["h/GPU-a", "h/GPU-b"])
    assert shared_gpu.is_shared(["h/GPU-a", "h/GPU-a"])


def test_bench_refuses_docs_benchmarks_outputs(tmp_path):
    bench_dir = tmp_path / "docs" / "benchmarks"
    bench_dir.mkdir(parents=True)
    inside, elsewhere = str(bench_dir / "h200.json"), str(tmp_path / "out.json")
    assert shared_gpu.refused_output([None, elsewhere], str(bench_dir)) is None
    assert shared_gpu.refused_output([elsewhere, inside], str(bench_dir)) == inside
    assert shared_gpu.refused_output([str(bench_dir)], str(bench_dir)) == str(bench_dir)  # the plots folder
    assert shared_gpu.docs_benchmarks_dir().endswith(os.path.join("docs", "benchmarks"))


def test_bench_labels_every_row():
    doc = shared_gpu.label({"results": [{"system": "deepcomm"}, {"system": "nccl-a2a"}]})
    assert doc["shared_gpu"] is True and all(r["shared_gpu"] is True for r in doc["results"])
