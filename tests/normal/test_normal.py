"""Normal dispatch + combine in 2, 3 and 4 CPU processes against the single-process brute force.

Every rank builds the global picture (all ranks' inputs) with all_gather_object and checks its own outputs
exactly: values, dtypes and row order.
"""
import zlib

import pytest
import torch
import torch.distributed as dist

from tests.helpers import bruteforce as bf
from tests.helpers.multiproc import run_ranks


def _to_wire(obj):
    # pickling float8 tensors is broken in torch's storage loader: ship them as bytes
    if isinstance(obj, torch.Tensor) and obj.dtype == torch.float8_e4m3fn:
        return ("fp8", obj.view(torch.uint8))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_wire(o) for o in obj)
    return obj


def _from_wire(obj):
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], str) and obj[0] == "fp8":
        return obj[1].view(torch.float8_e4m3fn)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_from_wire(o) for o in obj)
    return obj


def _gather(obj, world):
    out = [None] * world
    dist.all_gather_object(out, _to_wire(obj))
    return [_from_wire(o) for o in out]


def _equal(a, b, what):
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} vs {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), f"{what}: values differ"


# name, tokens(rank), hidden, slots, experts per rank, dtype, routing
SCENARIOS = [
    ("random-bf16-136", lambda r: 5 + 3 * r, 136, 4, 3, torch.bfloat16, "random"),
    ("random-fp32-2880", lambda r: 7, 2880, 2, 2, torch.float32, "random"),
    ("one-expert", lambda r: 6, 64, 3, 2, torch.bfloat16, "one_expert"),
    ("zero-and-one-token", lambda r: 0 if r == 0 else 1, 16, 2, 1, torch.float16, "random"),
    ("all-minus-one-on-rank1", lambda r: 4, 8, 2, 2, torch.float64, "none_on_1"),
    ("fp8-fp32-scales", lambda r: 9 - r, 256, 3, 2, "fp8", "random"),
    ("fp8-packed-scales", lambda r: 3 + r, 1024, 2, 2, "fp8_ue8m0", "random"),
]


def _inputs(rank, world, scenario):
    name, tokens, hidden, slots, per_rank, dtype, routing = scenario
    from deepcomm.fp8 import pack_ue8m0, per_token_cast_to_fp8
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) % 1000 + 17 * rank)
    num_tokens, experts = tokens(rank), per_rank * world
    idx = bf.make_topk(gen, num_tokens, min(slots, experts), experts, p_empty=0.25)
    if routing == "one_expert":
        idx = torch.full_like(idx, -1)
        idx[:, 0] = experts - 1
    elif routing == "none_on_1" and rank == 1:
        idx = torch.full_like(idx, -1)
    weights = torch.rand(idx.shape, generator=gen)
    base = torch.randn(num_tokens, hidden, generator=gen) * 4
    if dtype == "fp8":
        x = per_token_cast_to_fp8(base)
    elif dtype == "fp8_ue8m0":
        values, scales = per_token_cast_to_fp8(base, use_ue8m0=True)
        x = (values, pack_ue8m0(scales))
    else:
        x = base.to(dtype)
    return x, idx, weights, experts


def _normal_worker(rank, world):
    import deepcomm
    buf = deepcomm.Buffer(max_tokens_per_rank=64, hidden=4096, backend="auto", timeout_s=60)
    assert buf.backend_name == "reference" and buf.rank == rank and buf.world_size == world
    for scenario in SCENARIOS:
        what = f"[{scenario[0]} rank {rank}/{world}]"
        x, idx, w, experts = _inputs(rank, world, scenario)
        xs, idxs, ws = zip(*_gather((x, idx, w), world))
        is_pair = isinstance(x, tuple)

        # layout
        per_rank, per_expert, in_rank = buf.get_dispatch_layout(idx, experts)
        want = bf.layout(idx, experts, world)
        for got, exp, n in zip((per_rank, per_expert, in_rank), want[:3], ("per_rank", "per_expert", "in_rank")):
            _equal(got, exp, f"{what} layout {n}")

        # dispatch
        alignment = 4 if scenario[0] == "random-bf16-136" else 1
        recv_x, recv_idx, recv_w, counts, handle = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                                num_experts=experts, expert_alignment=alignment)
        rows, want_idx, want_w, want_counts = bf.dispatch(rank, xs, idxs, ws, experts, alignment)
        if is_pair:
            _equal(recv_x[0], bf.gather_rows(rows, [p[0] for p in xs]), f"{what} recv values")
            _equal(recv_x[1], bf.gather_rows(rows, [p[1] for p in xs]), f"{what} recv scales")
        else:
            _equal(recv_x, bf.gather_rows(rows, xs), f"{what} recv_x")
        _equal(recv_idx, want_idx, f"{what} recv_topk_idx")
        _equal(recv_w, want_w, f"{what} recv_topk_weights")
        assert counts == want_counts == handle.num_recv_tokens_per_expert, f"{what} counts {counts} {want_counts}"

        # handle
        assert handle.buffer_id == buf.buffer_id and handle.num_tokens == idx.shape[0]
        assert handle.num_recv == len(rows) and handle.num_experts == experts
        _equal(handle.is_token_in_rank, want[2], f"{what} handle.is_token_in_rank")
        _equal(handle.send_pos, want[3], f"{what} handle.send_pos")
        _equal(handle.recv_src_idx, torch.tensor([t for _, t in rows], dtype=torch.int32), f"{what} recv_src_idx")
        want_matrix = torch.stack([bf.layout(i, experts, world)[0] for i in idxs])
        _equal(handle.count_matrix, want_matrix, f"{what} count_matrix")
        for (s, t), row in zip(rows, range(len(rows))):  # the documented row formula
            assert int(handle.count_matrix[:s, rank].sum()) + int(_gather_pos(s, t, rank, idxs, experts)) == row

        # cached re-dispatch follows the same route; weights arrive unmasked
        again = buf.dispatch(x, topk_weights=w, handle=handle)
        if is_pair:
            _equal(again[0][0], recv_x[0], f"{what} cached values")
            _equal(again[0][1], recv_x[1], f"{what} cached scales")
        else:
            _equal(again[0], recv_x, f"{what} cached recv_x")
        assert again[1] is None and again[3] == counts and again[4] is handle
        _equal(again[2], bf.gather_rows(rows, ws), f"{what} cached weights")

        # combine of per-rank "expert outputs"
        if is_pair:
            continue
        y = (recv_x.double() * (rank + 1) - 0.5).to(recv_x.dtype)
        yw = recv_w * (rank + 2)
        ys, yws = zip(*_gather((y, yw), world))
        rows_at = [bf.dispatch(d, xs, idxs, None, experts)[0] for d in range(world)]
        combined, combined_w = buf.combine(y, handle, topk_weights=yw)
        _equal(combined, bf.combine(rank, ys, rows_at, idxs, experts, y.dtype), f"{what} combined_x")
        _equal(combined_w, bf.combine(rank, yws, rows_at, idxs, experts, torch.float32), f"{what} combined_w")
        assert buf.combine(y, handle)[1] is None
    buf.synchronize()
    buf.destroy()
    buf.destroy()  # idempotent
    return True


def _gather_pos(src, token, dst, idxs, experts):
    return bf.layout(idxs[src], experts, len(idxs))[3][token, dst]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_dispatch_combine_match_single_process(world):
    assert run_ranks(_normal_worker, world) == [True] * world


def _one_row_misaligned_worker(rank, world):
    import deepcomm
    from deepcomm.fp8 import pack_ue8m0, per_token_cast_to_fp8
    buf = deepcomm.Buffer(backend="reference", max_tokens_per_rank=4, hidden=512)
    # FP8 with packed UE8M0 scales: 512 + 4 bytes per row, so the int64 top-k ids that follow in one exchanged row
    # start at byte 516 (not a multiple of 8); with exactly one row received the unpacked view kept that offset.
    x = torch.randn(1, 512).to(torch.bfloat16)
    vals, scales = per_token_cast_to_fp8(x, use_ue8m0=True)
    idx = torch.tensor([[0 if rank == 1 else 2]])  # each rank sends its one token to the other rank (E=4, R=2)
    recv_x, recv_idx, _, _, handle = buf.dispatch((vals, pack_ue8m0(scales)), topk_idx=idx, num_experts=4)
    assert recv_x[0].shape == (1, 512) and handle.num_recv == 1
    assert recv_idx.tolist() == [[0]]  # the peer's expert, as this rank's local id
    return True


def test_one_received_row_with_misaligned_fields():
    assert run_ranks(_one_row_misaligned_worker, 2) == [True, True]
