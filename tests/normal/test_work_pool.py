"""Fresh-dispatch workspaces taken again from the CUDA backend's pool (deepcomm/cuda/work_pool.py): a workspace is
handed out only when nothing else holds it (no handle, no output, no view of it), never after a view of it was made,
never for a worst-case (graph-capturable) dispatch; the pool stays bounded. On the CPU, with the stand-ins of the
NVLink context (tests/helpers/nvl_stand_ins.py) and the pool alone."""
import pytest
import torch

from deepcomm.cuda import work_pool as P
from tests.helpers.nvl_stand_ins import C, cpu_backend

needs_ext = pytest.mark.skipif(C is None, reason="needs the extension deepcomm._C (its layouts and flags)")


@pytest.fixture
def env(monkeypatch):
    return cpu_backend(monkeypatch.setattr)


def _fresh(b, T=64, worst=0):
    x = torch.zeros(T, 1024, dtype=torch.bfloat16)
    idx = torch.zeros(T, 4, dtype=torch.int64)
    return b.dispatch(x, idx, torch.zeros(T, 4), 8, None, 1, num_worst_tokens=worst)


def _work(handle) -> torch.Tensor:
    return handle.__dict__["_send_pos"].base


@needs_ext
def test_a_workspace_is_taken_again_only_once_its_handle_and_outputs_are_gone(env):
    b = env.b
    out = _fresh(b)
    first = _work(out[-1]).data_ptr()
    held = _fresh(b)  # the first call's handle is alive: another workspace
    assert _work(held[-1]).data_ptr() != first
    del out
    again = _fresh(b)
    assert _work(again[-1]).data_ptr() == first
    assert b._work_pool.held() == 2


@needs_ext
def test_an_output_alone_keeps_nothing_of_the_workspace_but_the_handle_does(env):
    b = env.b
    recv_x, _, _, _, h = _fresh(b)
    ptr = _work(h).data_ptr()
    del h  # recv_x holds its arena block, not the workspace
    assert _work(_fresh(b)[-1]).data_ptr() == ptr
    del recv_x


@needs_ext
def test_a_workspace_whose_view_was_made_is_never_taken_again(env):
    b = env.b
    *_, h = _fresh(b)
    ptr = _work(h).data_ptr()
    slot = h.__dict__["_count_matrix"].slot
    count_matrix = h.count_matrix  # a view of the workspace that outlives the handle
    assert slot.escaped and slot.work is None  # the pool keeps its memory no longer
    del h
    *_, h2 = _fresh(b)
    assert _work(h2).data_ptr() != ptr and count_matrix.data_ptr() != _work(h2).data_ptr()
    del h2
    *_, h3 = _fresh(b)  # the escaped slot left the pool on the way
    assert _work(h3).data_ptr() != ptr


@needs_ext
def test_worst_case_dispatches_do_not_use_the_pool(env):
    b = env.b
    *_, h = _fresh(b, worst=100)
    assert b._work_pool.held() == 0 and h.__dict__["_send_pos"].slot is None


@needs_ext
def test_the_same_routes_come_back_from_a_reused_workspace(env):
    """What the handle reads through its workspace does not depend on which pooled tensor carries it."""
    b = env.b
    *_, h = _fresh(b, T=32)
    ptrs = [_work(h).data_ptr()]
    del h
    *_, h = _fresh(b, T=48)  # another token count of the same size class: the same tensor, carved for 48 tokens
    assert _work(h).data_ptr() == ptrs[0]
    assert h.send_pos.shape == (48, 1) and h.recv_src_idx.shape == (48,)
    assert env.ctx.calls[-1]["send_pos"] == h.send_pos.data_ptr()


def test_the_pool_is_bounded_per_size_class_and_in_classes(monkeypatch):
    monkeypatch.setattr(P, "SLOTS_PER_SIZE", 3)
    monkeypatch.setattr(P, "SIZE_CLASSES", 2)
    pool = P.WorkPool(torch.device("cpu"))
    busy = [pool.take(100).work for _ in range(5)]  # all held: five tensors, three kept
    assert len({t.data_ptr() for t in busy}) == 5 and pool.held() == 3
    assert all(t.numel() == 128 for t in busy)
    pool.take(1000)
    pool.take(5000)  # a third size class is not kept
    assert pool.held() == 4
    del busy
    assert pool.take(65).work.numel() == 128 and pool.held() == 4


def test_a_long_held_workspace_at_the_head_does_not_stop_reuse():
    pool = P.WorkPool(torch.device("cpu"))
    kept = pool.take(10).work  # held for long, like a handle reused for many cached dispatches
    t = pool.take(10).work  # what is held is the tensor (a handle's WorkspaceViews.base), not the slot
    ptr = t.data_ptr()
    assert ptr != kept.data_ptr()
    del t
    for _ in range(4):  # the free one is found behind the held one every time
        got = pool.take(10).work
        assert got.data_ptr() == ptr
        del got
    assert pool.held() == 2 and kept.numel() == 16
