"""The dispatch operator's outputs (deepcomm/custom_ops.py, what compiled graphs run) over the NVLink backend's host
path, on the CPU with its stand-ins (tests/helpers/nvl_stand_ins.py): the handle's routing tensors, parts of one
workspace, leave as tensors with storages of their own over the same bytes (deepcomm/cuda/owned_views.py), equal to
the handle's own views, keeping the workspace alive; without OwnedViews they are copies with the same values; the
absent outputs are empty; the per-expert counts are an int32 CPU tensor equal to the Buffer's list."""
import gc
import weakref

import pytest
import torch

from deepcomm import agreement, custom_ops
from deepcomm.cuda import owned_views
from deepcomm.handle import WorkspaceViews
from tests.helpers.multiproc import run_ranks
from tests.helpers.nvl_stand_ins import C, Patches, cpu_backend, put_behind_buffer

pytestmark = pytest.mark.skipif(C is None, reason="needs the extension deepcomm._C (its layouts and flags)")


def _fresh_handle(b, T=40, K=4, E=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, 1024, generator=gen).to(torch.bfloat16)
    idx = torch.randint(-1, E, (T, K), generator=gen)
    out = b.dispatch(x, idx, None, E, None, 1, fingerprint=agreement.dispatch(1, 2, x, idx, None, E, None))
    return out[-1]


def _storage(t: torch.Tensor) -> int:
    """Which storage ``t`` is a view of (its StorageImpl's address: the same for views sharing one)."""
    return t.untyped_storage()._cdata


def _fill(ws: WorkspaceViews, seed: int) -> None:
    """Random routing values in the workspace (the stand-in's kernels write none): 0 or 1 in every int32, so the
    bool view's bytes are valid."""
    ws.base.copy_(torch.randint(0, 2, ws.base.shape, generator=torch.Generator().manual_seed(seed),
                                dtype=ws.base.dtype))


@pytest.mark.parametrize("seed", range(4))
def test_routing_outputs_are_the_workspace_views_with_storages_of_their_own(monkeypatch, seed):
    if owned_views.owned_views() is None:
        pytest.skip("this torch has no DLPack exchange table")
    b = cpu_backend(monkeypatch.setattr).b
    h = _fresh_handle(b, T=17 + 9 * seed, seed=seed)
    ws = h.__dict__["_is_token_in_rank"]
    assert type(ws) is WorkspaceViews
    _fill(ws, seed)
    alive = weakref.ref(ws.base)
    routing, empties = custom_ops._routing_outputs(h, 2, b.device)
    assert ws.slot is None or ws.slot.escaped  # the pool no longer hands this workspace out
    want = [getattr(h, name) for name in custom_ops.ROUTING]  # torch's views of the same workspace
    for name, got, view in zip(custom_ops.ROUTING, routing, want):
        assert got.dtype == view.dtype and got.shape == view.shape, name
        assert got.data_ptr() == view.data_ptr() and torch.equal(got, view), name
        assert got._base is None, name
    storages = {_storage(t) for t in routing}
    assert len(storages) == 4 and _storage(ws.base) not in storages
    assert [(t.shape, t.dtype) for t in empties] == [(torch.Size([0]), torch.float32)] * 2
    values = [t.clone() for t in routing]
    del h, ws, want, got, view
    gc.collect()
    assert alive() is not None  # the outputs keep the workspace
    assert all(torch.equal(a, b) for a, b in zip(routing, values))
    del routing, empties
    gc.collect()
    assert alive() is None


def test_without_owned_views_the_routing_outputs_are_copies(monkeypatch):
    b = cpu_backend(monkeypatch.setattr).b
    h = _fresh_handle(b)
    _fill(h.__dict__["_is_token_in_rank"], 9)
    monkeypatch.setattr(custom_ops, "workspace_outputs", lambda *a: None)
    routing, empties = custom_ops._routing_outputs(h, 1, b.device)
    want = [getattr(h, name) for name in custom_ops.ROUTING]
    for got, view in zip(routing, want):
        assert torch.equal(got, view) and got.data_ptr() != view.data_ptr()
    assert len({_storage(t) for t in routing}) == 4 and len(empties) == 1


def _operator_outputs(rank, world):
    patches = Patches()
    try:
        import deepcomm
        buf = deepcomm.Buffer(max_tokens_per_rank=256, hidden=1024, backend="reference")
        state = cpu_backend(patches.setattr)
        put_behind_buffer(buf, state.b)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(33, 1024, generator=gen).to(torch.bfloat16)
        idx = torch.randint(-1, 8, (33, 4), generator=gen)
        per_expert = buf.dispatch(x, idx, num_experts=8, expert_alignment=4)[3]
        outs = torch.ops.deepcomm.dispatch(buf.buffer_id, x, None, idx, None, 8, 4, 0)
        named = dict(zip(custom_ops.DISPATCH_OUTPUTS, outs))
        routing = [named[name] for name in custom_ops.ROUTING]
        return {"counts": (named["num_recv_tokens_per_expert"].dtype, named["num_recv_tokens_per_expert"].device.type,
                           named["num_recv_tokens_per_expert"].tolist()),
                "list": per_expert,
                "absent": [tuple(named[k].shape) for k in ("recv_x_scales", "recv_topk_weights", "node_count_matrix")],
                "storages": len({_storage(t) for t in outs if t.numel()}),
                "present": sum(1 for t in outs if t.numel()),
                "routing shapes": [tuple(t.shape) for t in routing]}
    finally:
        patches.undo()


def test_the_operator_returns_counts_as_a_host_tensor_and_no_shared_storage():
    (out,) = run_ranks(_operator_outputs, 1, timeout=120)
    dtype, device, counts = out["counts"]
    assert dtype == torch.int32 and device == "cpu" and counts == list(out["list"]), out
    assert out["absent"] == [(0,)] * 3, out
    assert out["storages"] == out["present"], out  # no two outputs with elements share a storage
    assert out["routing shapes"] == [(33, 1), (33, 1), (1, 1), (33,)], out
