"""NVLink normal-mode kernels against the reference backend, bit for bit, on fresh random inputs."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.nccl_run import cuda_buffer, needs_ranks, rank_device, ranks_for_tests, reference, run_on_gpus, sms
from deepcomm.row_diff import differing_indices, differing_rows, explain_rows, received_rows

pytestmark = [pytest.mark.gpu,
              needs_ranks(2)]

WORLD = ranks_for_tests()


def _routing(gen, T, E, K, mode, device):
    if mode == "one_expert":
        idx = torch.zeros(T, K, dtype=torch.int64)
        idx[:, 1:] = -1
    else:
        scores = torch.rand(T, E, generator=gen).abs()
        idx = scores.topk(K, dim=1).indices
        if mode == "masked":
            idx[torch.rand(T, K, generator=gen) < 0.3] = -1
        if mode == "dup":  # two slots naming the same expert: counted once per token
            idx[:, 1] = idx[:, 0]
    weights = torch.rand(T, K, generator=gen)
    return idx.to(device), weights.to(device)


def _same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    if isinstance(a, (tuple, list)):
        for i, (u, w) in enumerate(zip(a, b)):
            _same(u, w, f"{what}[{i}]")
        return
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    if not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
        rows = differing_indices(a, b) if a.dim() else []
        raise AssertionError(f"{what} differs: {len(rows)} of {a.shape[0] if a.dim() else 1} rows, the first "
                             f"{rows[:8]}")


def _fresh_dispatch_same(cuda, ref, payload, idx, w, E, what):
    """A fresh dispatch on both Buffers, every output and the handle's routing compared; the two handles."""
    out_c = cuda.dispatch(payload, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=4)
    out_r = ref.dispatch(payload, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=4)
    for name, a, b in zip(("recv_x", "recv_topk_idx", "recv_topk_weights"), out_c[:3], out_r[:3]):
        _same(a, b, f"{what} dispatch {name}")
    assert out_c[3] == out_r[3], f"{what} tokens per expert {out_c[3]} vs {out_r[3]}"
    hc, hr = out_c[4], out_r[4]
    for name in ("is_token_in_rank", "send_pos", "count_matrix", "recv_src_idx"):
        _same(getattr(hc, name), getattr(hr, name), f"{what} handle.{name}")
    assert hc.num_recv == hr.num_recv
    return hc, hr


def _cases(rank):
    # (tokens per rank by rank, hidden, experts, topk, routing mode, dtype, num_sms)
    return [
        ((64, 80), 7168, 256, 8, "random", "bf16", 24),
        ((0, 33), 2048, 64, 4, "random", "bf16", 3),
        ((1, 1), 4096, 16, 2, "masked", "fp8", 1),
        ((300, 5), 2880, 32, 6, "masked", "bf16", 32),
        ((128, 128), 7168, 256, 8, "one_expert", "fp8", 8),
        ((257, 100), 7168, 256, 8, "random", "fp8_ue8m0", 24),
        ((513, 700), 4096, 128, 8, "masked", "bf16", 17),
        ((50, 70), 1024, 16, 4, "dup", "bf16", 5),
        # rows whose last vector pass leaves lanes idle (under 512 bytes; 520 vectors of 16 bytes): the warp's
        # shuffles in that pass must still see every lane
        ((40, 9), 128, 8, 2, "masked", "fp8", 4),
        ((17, 3), 64, 8, 2, "random", "bf16", 2),
        ((33, 70), 4160, 32, 4, "random", "bf16", 6),
    ]


def _kept_inputs(rank, i, dev):
    """``(topk_idx, topk_weights, x)`` of ``rank``'s ``i``-th kept dispatch, from a seed of their own, so that any
    rank can draw any rank's again (``_kept_recv_x``)."""
    gen = torch.Generator().manual_seed(50_000 + 100 * i + rank)
    idx, w = _routing(gen, 1024, 256, 8, "random", dev)
    return idx, w, torch.randn(1024, 7168, generator=gen).to(torch.bfloat16).to(dev)


def _kept_recv_x(rank, world, i, dev):
    """The recv_x ``rank`` must get from the ``i``-th kept dispatch, from every rank's inputs drawn again here: an
    oracle with no collective, to tell which side of a mismatch is wrong."""
    sent = [_kept_inputs(s, i, dev) for s in range(world)]
    return received_rows([(x, idx) for idx, _, x in sent], 256, rank)


def _kept_outputs_same(cuda, ref, rank, world, dev):
    """More dispatch outputs kept alive than the arena holds: later dispatches go through the exact-size and bounce
    placements (DEEPCOMM_ARENA_FULL), still bit-exact, and no kept output changes."""
    cuda.set_num_sms(sms(24))
    kept = []
    for i in range(10):
        idx, w, x = _kept_inputs(rank, i, dev)
        got = cuda.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=256)
        want = ref.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=256)
        for name, a, b in zip(("recv_x", "recv_topk_idx", "recv_topk_weights"), got[:3], want[:3]):
            why = explain_rows(a, b, want[4].count_matrix[:, rank].tolist(), [g[0] for g, _ in kept])
            if why and name == "recv_x":
                rows = _kept_recv_x(rank, world, i, dev)
                why += (f"; against every rank's inputs drawn again here, {differing_rows(a, rows)} rows of the "
                        f"CUDA backend and {differing_rows(b, rows)} of the reference differ")
            assert not why, (f"kept output {i} {name} (rows placed: {cuda._backend.last_placement}, arena "
                             f"{cuda._backend.arena.free_bytes()} of {cuda._backend.arena.nbytes} bytes free): {why}")
        kept.append((got, want[0]))
    # (the arena may be full for a block of this size with free bytes left in holes: count the bounces themselves)
    arena = cuda._backend.arena
    assert cuda._backend.bounced_calls > 0, \
        f"no dispatch went through the bounce area: {arena.free_bytes()} of {arena.nbytes} arena bytes free"
    for i, (got, want_x) in enumerate(kept):
        _same(got[0], want_x, f"kept output {i} recv_x, after the later dispatches")
    return cuda._backend.placements


def _intranode_worker(rank, world):
    from deepcomm.fp8 import pack_ue8m0, per_token_cast_to_fp8

    dev = rank_device(rank)
    gen = torch.Generator().manual_seed(1234 + rank)
    cuda = cuda_buffer(max_tokens_per_rank=1024, hidden=7168, num_sms=24, timeout_s=20)
    ref = reference(dev, max_tokens_per_rank=1024, hidden=7168)
    for case_no, (tokens, H, E, K, mode, dtype, num_sms) in enumerate(_cases(rank)):
        T = tokens[rank % len(tokens)]  # more ranks than listed: the pattern repeats
        what = f"case {case_no} ({tokens}, H={H}, {mode}, {dtype}, sms={sms(num_sms)})"
        cuda.set_num_sms(sms(num_sms))
        idx, w = _routing(gen, T, E, K, mode, dev)
        x = (torch.randn(T, H, generator=gen) * 3).to(torch.bfloat16).to(dev)
        if dtype == "bf16":
            payload = x
        else:
            vals, scales = per_token_cast_to_fp8(x, use_ue8m0=(dtype == "fp8_ue8m0"))
            payload = (vals, pack_ue8m0(scales) if dtype == "fp8_ue8m0" else scales)

        lay_c = cuda.get_dispatch_layout(idx, E)
        lay_r = ref.get_dispatch_layout(idx, E)
        for name, a, b in zip(("tokens_per_rank", "tokens_per_expert", "is_token_in_rank"), lay_c, lay_r):
            _same(a, b, f"{what} layout {name}")

        hc, hr = _fresh_dispatch_same(cuda, ref, payload, idx, w, E, what)

        # cached re-dispatch follows the same route
        again = cuda.dispatch(payload, handle=hc, topk_weights=w)
        again_r = ref.dispatch(payload, handle=hr, topk_weights=w)
        _same(again[0], again_r[0], f"{what} cached recv_x")
        _same(again[2], again_r[2], f"{what} cached weights")

        # combine of "expert outputs" (fresh bf16 rows), with and without weights
        y = (torch.randn(hc.num_recv, H, generator=gen)).to(torch.bfloat16).to(dev)
        rw = torch.rand(hc.num_recv, K, generator=gen).to(dev)
        comb_c = cuda.combine(y, hc, topk_weights=rw)
        comb_r = ref.combine(y, hr, topk_weights=rw)
        _same(comb_c[0], comb_r[0], f"{what} combine x")
        _same(comb_c[1], comb_r[1], f"{what} combine weights")
        # back-to-back combines on the same handle (staging reuse) stay exact
        for _ in range(3):
            y2 = torch.randn(hc.num_recv, H, generator=gen).to(torch.bfloat16).to(dev)
            _same(cuda.combine(y2, hc)[0], ref.combine(y2, hr)[0], f"{what} repeated combine")
    _kept_outputs_same(cuda, ref, rank, world, dev)

    # Expert ids out of range are caught by the notify kernel on every rank; the buffer stays usable.
    idx, w = _routing(gen, 16, 32, 2, "random", dev)
    bad = idx.clone()
    if rank == 0:
        bad[3, 1] = 32
    x = torch.randn(16, 1024, generator=gen).to(torch.bfloat16).to(dev)
    with pytest.raises(ValueError, match="topk_idx"):
        cuda.dispatch(x, topk_idx=bad, num_experts=32)
    out = cuda.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=32)
    _same(out[0], ref.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=32)[0], "dispatch after a rejected call")
    cuda.synchronize()
    cuda.destroy()
    ref.destroy()


def _many_chunks_worker(rank, world):
    """Fresh dispatches of many notify chunks (up to 12 of 512 tokens each, their number changing from call to call
    and from rank to rank), each followed by a cached dispatch and a combine of its handle: bit-exact against the
    reference backend, the handle's send positions included."""
    dev = rank_device(rank)
    gen = torch.Generator().manual_seed(4321 + rank)
    cuda = cuda_buffer(max_tokens_per_rank=6144, hidden=512, num_sms=24, timeout_s=20)
    ref = reference(dev, max_tokens_per_rank=6144, hidden=512)
    cuda.set_num_sms(sms(24))
    rounds = [(6000, 4097, 513, 6144), (4097, 1, 5000, 0), (6144, 2999, 512, 1025)]
    for i, tokens in enumerate(rounds):
        T = tokens[rank % len(tokens)]
        mode = "masked" if i % 2 else "random"
        what = f"many chunks, round {i} (T={T}, {mode})"
        idx, w = _routing(gen, T, 64, 8, mode, dev)
        x = (torch.randn(T, 512, generator=gen) * 3).to(torch.bfloat16).to(dev)
        hc, hr = _fresh_dispatch_same(cuda, ref, x, idx, w, 64, what)
        _same(cuda.dispatch(x, handle=hc)[0], ref.dispatch(x, handle=hr)[0], f"{what} cached recv_x")
        y = torch.randn(hc.num_recv, 512, generator=gen).to(torch.bfloat16).to(dev)
        _same(cuda.combine(y, hc)[0], ref.combine(y, hr)[0], f"{what} combine")
    cuda.synchronize()
    cuda.destroy()
    ref.destroy()


def _kept_copies_worker(rank, world):
    """The kept outputs of _intranode_worker with DEEPCOMM_ARENA_FULL=copy: a fresh dispatch that finds the arena
    full goes straight into the bounce area (never an exact-size block), still bit-exact."""
    import os
    os.environ["DEEPCOMM_ARENA_FULL"] = "copy"  # this rank's process only, read when its Buffer is built
    dev = rank_device(rank)
    cuda = cuda_buffer(max_tokens_per_rank=1024, hidden=7168, num_sms=24, timeout_s=20)
    ref = reference(dev, max_tokens_per_rank=1024, hidden=7168)
    placements = _kept_outputs_same(cuda, ref, rank, world, dev)
    assert placements["exact"] == 0 and placements["bounce"] > 0, placements
    cuda.synchronize()
    cuda.destroy()
    ref.destroy()


def test_intranode_matches_reference():
    run_on_gpus(_intranode_worker, WORLD)


def test_kept_outputs_with_arena_full_copies_match_reference():
    run_on_gpus(_kept_copies_worker, WORLD)


def test_fresh_dispatches_of_many_notify_chunks_match_reference():
    run_on_gpus(_many_chunks_worker, WORLD)
