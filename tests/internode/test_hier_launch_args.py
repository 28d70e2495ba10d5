"""The typed arguments of the hierarchical launches (csrc/bindings/hier_launch.hpp, bound by typed_args.hpp in
deepcomm._C.transport): every field a keyword, checked when built (TypeError for a missing, unknown or mistyped
field, ValueError naming a value out of range), every member of the C++ structs bound; and what
deepcomm/internode/hier_kernels.py builds for a fresh dispatch, a cached one and a combine, with the ranks as
threads and the launches recorded instead of run (CPU). deepcomm._nvshmem_kernels takes the same objects. The
kernels themselves run in tests/internode/test_internode.py."""
from __future__ import annotations

import os
import re

import pytest
import torch

from deepcomm._ext import load_extension

from tests.helpers.hier_stand_ins import recording_kernels, recording_world
from tests.helpers.paths import ROOT

C = load_extension()
pytestmark = pytest.mark.skipif(C is None, reason="deepcomm._C is not built (no nvcc at install time)")

COMMON = dict(num_nodes=2, gpus=2, node=1, local=0, peers=0x100, num_peers=1, lkey=7, round=3, chunk_bytes=4096,
              log_wqebbs=6, log_cqes=6, send=0x1000, recv=0x2000, signal=0x3000, signal_target=3, credit=0,
              nvshmem_puts=False, slot_bytes=1 << 20, header_bytes=64, emulate_nic=True, nic_blocks=2,
              area=[0x10, 0x20], free_words=[0x30, 0x40], arrive_words=[0x50, 0x60], epoch=5, words_at=-1, counters=0x70,
              counters_next=0x90, rdma_blocks=4, nvl_blocks=4, err_dev=0x80, timeout_s=2.5)
DISPATCH = dict(x=0x200, scales=0, topk_idx=0x400, topk_weights=0x410, x_bytes=32, scale_bytes=0, topk=2,
                with_idx=True, with_weights=True, num_tokens=9, out_x=0x420, out_scales=0, out_topk_idx=0x430,
                out_src_idx=0x440, out_weights=0x450, first_expert=16, local_experts=8, num_recv=11, masks=0x210,
                rdma_slot=0x220, rows_to=[3, 4], rows_from=[5, 6], first_row=0x230, route=0x240, singles=0x250, max_rows=6)
COMBINE = dict(held_stride=32, w_off=16, hidden=8, topk=2, fp8=False, own_x=0x310, own_w=0x320,
               own_begin=1, gather=0x330, route=0x340, singles=0x350, max_rows=6, rows_from=[5, 6],
               area_off=0x360, partial_stride=48, rdma_slot=0x370, held_slot=0x374, one_held=0x378, num_tokens=9,
               out_x=0x380, out_w=0x390)


def _members(struct: str):
    """The data members of ``struct`` in csrc/bindings/hier_launch.hpp, in order."""
    with open(os.path.join(ROOT, "csrc", "bindings", "hier_launch.hpp")) as f:
        text = f.read()
    body = text[text.index(f"struct {struct} {{"):]
    body = body[:body.index("  void check() const")]
    names = []
    for decl in re.findall(r"^  (?!//)[\w:<>]+ ([^;(]+);", body, re.M):
        names += [re.sub(r"\s*=.*", "", part).strip() for part in decl.split(",")]
    return tuple(names)


@pytest.mark.parametrize("name", ["HierLaunch", "HierDispatchLaunch", "HierCombineLaunch"])
def test_every_member_is_a_bound_field(name):
    assert getattr(C.transport, name).FIELDS == _members(name)


def test_fields_read_back_as_built():
    T = C.transport
    common = T.HierLaunch(**COMMON)
    for key, value in COMMON.items():
        assert getattr(common, key) == value, key
    d = T.HierDispatchLaunch(common=common, **DISPATCH)
    assert d.common.area == [0x10, 0x20] and d.rows_to == [3, 4] and d.max_rows == 6
    assert (d.first_expert, d.local_experts) == (16, 8)
    c = T.HierCombineLaunch(common=common, **COMBINE)
    assert c.common.epoch == 5 and c.rows_from == [5, 6] and c.out_w == 0x390


def test_missing_unknown_and_mistyped_fields_are_type_errors():
    T = C.transport
    with pytest.raises(TypeError, match="HierLaunch: missing field epoch"):
        T.HierLaunch(**{k: v for k, v in COMMON.items() if k != "epoch"})
    with pytest.raises(TypeError, match="HierLaunch: unexpected field rank"):
        T.HierLaunch(**COMMON, rank=2)
    with pytest.raises(TypeError, match="HierLaunch.lkey"):
        T.HierLaunch(**dict(COMMON, lkey=-1))
    with pytest.raises(TypeError, match="HierDispatchLaunch.rows_to"):
        T.HierDispatchLaunch(common=T.HierLaunch(**COMMON), **dict(DISPATCH, rows_to="3, 4"))
    with pytest.raises(TypeError, match="HierCombineLaunch.common"):
        T.HierCombineLaunch(common=COMMON, **COMBINE)


@pytest.mark.parametrize("change,field", [
    (dict(num_nodes=0), "num_nodes"),
    (dict(gpus=33, area=[0] * 33, free_words=[0] * 33, arrive_words=[0] * 33), "gpus"),
    (dict(num_nodes=32, gpus=16, area=[0] * 16, free_words=[0] * 16, arrive_words=[0] * 16), "num_nodes \\* gpus"),
    (dict(node=2), "node"), (dict(local=-1), "local"), (dict(nic_blocks=0), "nic_blocks"),
    (dict(area=[0x10]), "area"), (dict(free_words=[1, 2, 3]), "free_words"), (dict(arrive_words=[]), "arrive_words"),
    (dict(rdma_blocks=0), "rdma_blocks"), (dict(nvl_blocks=0), "nvl_blocks"), (dict(timeout_s=-1.0), "timeout_s"),
    (dict(words_at=8), "words_at"), (dict(words_at=-2), "words_at"),
])
def test_shared_values_out_of_range_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        C.transport.HierLaunch(**dict(COMMON, **change))


@pytest.mark.parametrize("kind,change,field", [
    ("dispatch", dict(rows_to=[3]), "rows_to"), ("dispatch", dict(rows_from=[5, -1]), "rows_from"),
    ("dispatch", dict(num_tokens=-1), "num_tokens"), ("dispatch", dict(max_rows=-1), "max_rows"),
    ("dispatch", dict(x_bytes=24), "x_bytes"), ("dispatch", dict(scale_bytes=6), "scale_bytes"),
    ("dispatch", dict(topk=33), "topk"), ("dispatch", dict(num_recv=-1), "num_recv"),
    ("dispatch", dict(local_experts=-1), "local_experts"), ("dispatch", dict(first_expert=-3), "first_expert"),
    ("combine", dict(rows_from=[5, 6, 7]), "rows_from"), ("combine", dict(hidden=0), "hidden"),
    ("combine", dict(topk=-1), "topk"), ("combine", dict(own_begin=-2), "own_begin"),
    ("combine", dict(held_slot=0), "held_slot"), ("combine", dict(rdma_slot=0), "rdma_slot"),
    ("combine", dict(one_held=0), "one_held"),  # COMMON has 2 GPUs per node
])
def test_launch_values_out_of_range_name_the_field(kind, change, field):
    T = C.transport
    cls, fields = (T.HierDispatchLaunch, DISPATCH) if kind == "dispatch" else (T.HierCombineLaunch, COMBINE)
    with pytest.raises(ValueError, match=field):
        cls(common=T.HierLaunch(**COMMON), **dict(fields, **change))


def test_check_sees_a_field_changed_after_building():
    d = C.transport.HierDispatchLaunch(common=C.transport.HierLaunch(**COMMON), **DISPATCH)
    d.check()
    d.rows_to = [1, 2, 3]
    with pytest.raises(ValueError, match="rows_to"):
        d.check()


def test_the_nvshmem_module_takes_the_same_objects():
    """deepcomm._nvshmem_kernels has no classes of its own: it converts deepcomm._C's, and then refuses the launch
    only because its device state is not registered (no NVSHMEM here)."""
    from deepcomm.internode import nvshmem_kernels
    if nvshmem_kernels.unavailable_reason() is not None:
        pytest.skip(nvshmem_kernels.unavailable_reason())
    m = nvshmem_kernels.load_device_kernels()
    assert not hasattr(m, "HierLaunch")
    T = C.transport
    common = T.HierLaunch(**COMMON)
    with pytest.raises(RuntimeError, match="init_device_state"):
        m.hier_dispatch(T.HierDispatchLaunch(common=common, **DISPATCH), 0)
    with pytest.raises(RuntimeError, match="init_device_state"):
        m.hier_combine(T.HierCombineLaunch(common=common, **COMBINE), 0)
    with pytest.raises(TypeError):
        m.hier_dispatch(dict(DISPATCH), 0)


# ---- what hier_kernels.py builds ----------------------------------------------------------------------------------
E, K, H, M = 16, 2, 64, 32


@pytest.mark.parametrize("nodes,gpn", [(2, 1), (2, 2)])
def test_hier_kernels_builds_typed_launches(monkeypatch, nodes, gpn):
    from deepcomm.internode import hier_kernels
    from deepcomm.internode.internode_rows import RAIL_HEADER_BYTES
    from deepcomm.internode.internode_rows import max_node_row_bytes
    from tests.helpers.threaded_world import World, run

    recording_world(monkeypatch.setattr)
    R = nodes * gpn
    world = World(R, gpn, area_bytes=R * M * max_node_row_bytes(H), timeout_s=120.0)

    def fn(rank):
        launches = []
        k = recording_kernels(world, rank, launches, M, H)
        gen = torch.Generator().manual_seed(rank)
        T = 5 + rank
        idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.contiguous()
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
        w = torch.rand(T, K, generator=gen)
        *_, handle = hier_kernels.dispatch(k, x, idx, w, E, None, 1)
        hier_kernels.dispatch(k, x, None, w, E, handle, 1)
        recv = sum(handle.count_matrix[:, rank].tolist())
        hier_kernels.combine(k, torch.zeros(recv, H, dtype=torch.bfloat16), handle, torch.zeros(recv, K))
        assert [kind for kind, _ in launches] == ["dispatch", "dispatch", "combine"]
        counts = handle.count_matrix.tolist()
        ncounts = handle.node_count_matrix.tolist()
        plan = hier_kernels.dispatch_plan(k.comm, counts, ncounts, handle.is_token_in_rank, 16)
        for i, (_, launch) in enumerate(launches):
            c = launch.common
            assert (c.num_nodes, c.gpus, c.node, c.local) == (nodes, gpn, rank // gpn, rank % gpn)
            assert c.round == i + 1 and c.signal_target == i + 1 and c.epoch == i + 1
            assert (c.send, c.recv, c.signal, c.credit) == (0x10000, 0x10100, 0x10200, 0)
            assert c.area == k.link.area_ptrs() and c.free_words == k.link.word_ptrs("free")
            assert c.arrive_words == k.link.word_ptrs("arrive") and c.header_bytes == RAIL_HEADER_BYTES
            assert (c.rdma_blocks, c.nvl_blocks, c.nic_blocks) == (3, 5, 2) and c.emulate_nic and not c.nvshmem_puts
            # the launches count in the two counter sets in turn, each zeroing the other for the next
            mine, other = k.counters.data_ptr() + 16 * (i % 2), k.counters.data_ptr() + 16 * ((i + 1) % 2)
            assert c.counters == mine and c.counters_next == other and c.timeout_s == 2.0
        recv_rows = sum(counts[s][rank] for s in range(R))
        for i, (_, d) in enumerate(launches[:2]):
            assert d.num_tokens == T and d.rows_to == plan["rows_to"] and d.rows_from == plan["rows_from"]
            assert d.max_rows == plan["max_rows"] and (d.masks != 0) == (gpn > 1)
            # the rows: built from the caller's tensors, split into the outputs (ids only on the fresh one)
            assert (d.x_bytes, d.scale_bytes, d.topk, d.with_weights) == (2 * H, 0, K, True)
            assert d.with_idx == (i == 0) and (d.topk_idx != 0) == (i == 0) and (d.out_src_idx != 0) == (i == 0)
            assert d.topk_weights == w.data_ptr() and d.num_recv == recv_rows
            assert d.out_x != 0 and d.out_weights != 0 and d.out_scales == 0
        c = launches[2][1]
        assert (c.hidden, c.topk, c.num_tokens, c.fp8) == (H, K, T, False)
        assert c.rows_from == handle.node_route.rows_from and c.max_rows == handle.node_route.route.shape[1]
        assert c.route == handle.node_route.route.data_ptr() and c.held_stride % 16 == 0
        return True

    assert all(run(world, fn))
