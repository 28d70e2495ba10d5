"""The rows of the hierarchical internode kernels (csrc/runtime/hier_rows.hpp) on the host: the C++ layout of a
dispatch row and of a combine's held row against the arithmetic of the torch routing (deepcomm/internode/
hier_normal.py: the reference's parts side by side, the node mask, 16-byte strides), and the word functions the
kernels call to build a row from the caller's tensors and to split a received row into the outputs, run by
deepcomm._selftest over CPU tensors, against torch's packing (pack_rows) and unpacking (unpack_rows). The kernels
themselves run in tests/internode/test_internode.py."""
from __future__ import annotations

import pytest
import torch

from deepcomm._ext import load_selftest, selftest_error
from deepcomm.cuda.align import round_up
from deepcomm.dispatch_rows import part_row_bytes, unpack_rows
from deepcomm.fp8 import pack_ue8m0, per_token_cast_to_fp8
from deepcomm.internode.hier_kernels import recv_outputs
from deepcomm.internode.hier_normal import node_masks, pack_rows, payload_parts
from deepcomm.internode.internode_layout import dispatch_row, held_row
from deepcomm.layout import to_local_experts

S = load_selftest()
pytestmark = pytest.mark.skipif(S is None, reason=f"deepcomm._selftest is not available ({selftest_error()})")

E = 64


def _x_parts(gen, T, H, kind):
    x = (torch.randn(T, H, generator=gen) * 3).to(torch.bfloat16)
    if kind == "bf16":
        return [x]
    values, scales = per_token_cast_to_fp8(x, use_ue8m0=kind == "ue8m0")
    return [values, pack_ue8m0(scales) if kind == "ue8m0" else scales]


def _ptr(t):
    return t.data_ptr() if t is not None else 0


CASES = [(T, H, kind, K, fresh, weighted, G)
         for T, H, kind in [(0, 64, "bf16"), (1, 8, "bf16"), (9, 72, "bf16"), (7, 256, "fp8"), (5, 512, "ue8m0")]
         for K in (1, 4)
         for fresh, weighted in [(True, True), (True, False), (False, True), (False, False)]
         for G in (1, 2, 8)]


@pytest.mark.parametrize("T,H,kind,K,fresh,weighted,G", CASES)
def test_dispatch_rows_built_and_split_like_torch(T, H, kind, K, fresh, weighted, G):
    gen = torch.Generator().manual_seed(T * 1000 + H + K)
    xs = _x_parts(gen, T, H, kind)
    idx = torch.randint(-1, E, (T, K), generator=gen)
    w = torch.rand(T, K, generator=gen) if weighted else None
    parts = payload_parts(xs, idx, w, fresh)
    row_bytes = [part_row_bytes(p) for p in parts]
    # the torch routing's arithmetic (hier_normal.dispatch)
    mask_at = sum(row_bytes)
    stride = round_up(mask_at + (4 if G > 1 else 0), 16)
    scale_bytes = row_bytes[1] if len(xs) > 1 else 0
    row = dispatch_row(row_bytes[0], scale_bytes, K, fresh, weighted, G)
    assert row["stride"] == stride and row["mask_off"] == mask_at
    at = [sum(row_bytes[:i]) for i in range(len(parts))]
    names = ["x"] + (["scale_off"] if len(xs) > 1 else []) + (["idx_off", "src_off"] if fresh else []) + \
            (["w_off"] if weighted else [])
    for name, o in zip(names[1:], at[1:]):
        assert row[name] == o, name

    # built by the kernels' word function: torch's packing, with the node mask of one node at mask_off
    masks = torch.tensor(node_masks(torch.rand(T, 2 * G, generator=gen) < 0.5, 2, G)[:, 1].tolist(),
                         dtype=torch.int32)
    got = torch.full((T, stride), 0xAB, dtype=torch.uint8)
    assert S.hier_pack_rows_host(row_bytes[0], scale_bytes, K, fresh, weighted, G, _ptr(xs[0]),
                                 _ptr(xs[1]) if len(xs) > 1 else 0, _ptr(idx) if fresh else 0, _ptr(w),
                                 masks.data_ptr() if G > 1 else 0, T, got.data_ptr()) == stride
    want = pack_rows(parts, T, stride)
    if G > 1:
        want[:, mask_at:mask_at + 4] = masks.reshape(T, 1).view(torch.uint8)
    assert torch.equal(got, want)

    # split by the kernels' word function into the outputs (views of one block): torch's unpacking
    n = T
    outs = recv_outputs(n, xs, K, fresh, weighted, torch.device("cpu"))
    for o, p in zip(outs, parts):
        assert o.dtype == p.dtype and o.shape == p.shape
        o.view(torch.uint8).fill_(0xCD)
    ptrs = dict(zip(("x", "scales")[:len(xs)], outs))
    if fresh:
        ptrs.update(idx=outs[len(xs)], src=outs[len(xs) + 1])
    if weighted:
        ptrs["w"] = outs[-1]
    S.hier_unpack_rows_host(row_bytes[0], scale_bytes, K, fresh, weighted, G, got.data_ptr(), n,
                            *(_ptr(ptrs.get(k)) for k in ("x", "scales", "idx", "src", "w")))
    for o, p, u in zip(outs, parts, unpack_rows(want, parts, row_bytes)):
        assert torch.equal(o.view(torch.uint8), p.view(torch.uint8)) and torch.equal(o.view(torch.uint8),
                                                                                   u.view(torch.uint8))

    if fresh:  # the kernels' split of a fresh dispatch: local ids and masked weights, as the reference returns them
        for rank, L in ((0, 16), (3, 16), (1, 64), (5, 7)):
            local = recv_outputs(n, xs, K, fresh, weighted, torch.device("cpu"))
            for o in local:
                o.view(torch.uint8).fill_(0xCD)
            S.hier_unpack_rows_host(row_bytes[0], scale_bytes, K, fresh, weighted, G, got.data_ptr(), n,
                                    *(_ptr(o) for o in local[:len(xs)]), *([0] if len(xs) == 1 else []),
                                    _ptr(local[len(xs)]), _ptr(local[len(xs) + 1]),
                                    _ptr(local[-1]) if weighted else 0, first_expert=rank * L, local_experts=L)
            want_ids = to_local_experts(idx, rank, L)
            assert torch.equal(local[len(xs)], want_ids), (rank, L)
            assert torch.equal(local[len(xs) + 1], torch.arange(n, dtype=torch.int32))
            for o, p in zip(local[:len(xs)], xs):
                assert torch.equal(o.view(torch.uint8), p.view(torch.uint8))
            if weighted:
                masked = torch.where(want_ids >= 0, w, torch.zeros_like(w))
                assert torch.equal(local[-1].view(torch.int32), masked.view(torch.int32))


def test_recv_outputs_have_the_parts_shapes_and_do_not_overlap():
    gen = torch.Generator().manual_seed(3)
    xs = _x_parts(gen, 4, 256, "fp8")
    outs = recv_outputs(6, xs, 3, True, True, torch.device("cpu"))
    assert [(o.dtype, tuple(o.shape)) for o in outs] == [
        (torch.float8_e4m3fn, (6, 256)), (torch.float32, (6, 2)), (torch.int64, (6, 3)), (torch.int32, (6,)),
        (torch.float32, (6, 3))]
    spans = sorted((o.data_ptr(), o.numel() * o.element_size()) for o in outs)
    assert all(a % 16 == 0 for a, _ in spans)  # the kernel stores x in 16-byte vectors
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))
    empty = recv_outputs(0, xs, 3, False, True, torch.device("cpu"))
    assert [tuple(o.shape) for o in empty] == [(0, 256), (0, 2), (0, 3)]


@pytest.mark.parametrize("n,H,K", [(0, 64, 2), (5, 8, 0), (6, 72, 3), (3, 256, 8)])
def test_held_rows_built_like_torch(n, H, K):
    gen = torch.Generator().manual_seed(n + H)
    x = torch.randn(n, H, generator=gen).to(torch.bfloat16)
    w = torch.rand(n, K, generator=gen) if K else None
    # the torch routing's held row: x at 0, weights at round_up(x bytes, 4), 16-byte stride
    for fp8 in (False, True):
        x_bytes = H + H // 128 * 4 if fp8 else 2 * H
        layout = held_row(H, K, fp8)
        assert layout["x_bytes"] == x_bytes and layout["w_off"] == round_up(x_bytes, 4)
        assert layout["stride"] == round_up(round_up(x_bytes, 4) + 4 * K, 16)
    stride = held_row(H, K, False)["stride"]
    got = torch.full((n, stride), 0xEE, dtype=torch.uint8)
    assert S.hier_held_rows_host(H, K, x.data_ptr(), _ptr(w), n, got.data_ptr()) == stride
    parts, at = [x] + ([w] if w is not None else []), [0] + ([held_row(H, K, False)["w_off"]] if w is not None else [])
    assert torch.equal(got, pack_rows(parts, n, stride, at=at))
