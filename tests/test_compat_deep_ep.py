"""deepcomm.compat.deep_ep: DeepEP V1's surface (arity, types, argument names) gives exactly deepcomm's results.

Runs in 2 CPU processes on the reference backend; each call is compared with the same call on the underlying
deepcomm.Buffer.
"""
import inspect

import pytest
import torch

import bruteforce as bf
from multiproc import run_ranks

HIDDEN, SLOTS, PER_RANK = 512, 3, 2


def _equal(a, b, what):
    assert (a is None) == (b is None), what
    if a is None:
        return
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(a.contiguous().flatten().view(torch.uint8), b.contiguous().flatten().view(torch.uint8)), \
        f"{what}: values differ"


def _inputs(rank, world, tokens):
    gen = torch.Generator().manual_seed(11 + rank)
    idx = bf.make_topk(gen, tokens, SLOTS, PER_RANK * world, p_empty=0.25)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    w = torch.rand(tokens, SLOTS, generator=gen)
    return x, idx, w


def _normal_worker(rank, world):
    from deepcomm import Handle
    from deepcomm.compat import deep_ep, install_deep_ep
    from deepcomm.fp8 import per_token_cast_to_fp8
    assert install_deep_ep() is deep_ep
    import deep_ep as imported  # unchanged DeepEP code finds the compat module
    assert imported.Buffer is deep_ep.Buffer

    E = PER_RANK * world
    buf = deep_ep.Buffer(None, int(1e9), 0, max_tokens_per_rank=32, hidden=HIDDEN)
    assert (buf.rank, buf.group_size, buf.num_nvl_bytes) == (rank, world, int(1e9))
    dc = buf.runtime
    x, idx, w = _inputs(rank, world, 9 + rank)

    # layout: 5-tuple, one node -> no per-RDMA-rank counts
    layout = buf.get_dispatch_layout(idx, E)
    assert len(layout) == 5 and layout[1] is None and isinstance(layout[4], deep_ep.EventOverlap)
    per_rank, _, per_expert, in_rank, event = layout
    for got, want, name in zip((per_rank, per_expert, in_rank), dc.get_dispatch_layout(idx, E),
                               ("per_rank", "per_expert", "in_rank")):
        _equal(got, want, name)
    with pytest.raises(RuntimeError):
        event.current_stream_wait()          # async_finish=False: no event, as in DeepEP
    with event:
        pass

    # fresh dispatch: 6-tuple, same results as deepcomm
    out = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=idx, topk_weights=w, expert_alignment=2, async_finish=True)
    assert len(out) == 6
    recv_x, recv_idx, recv_w, counts, handle, event = out
    event.current_stream_wait()
    # a previous event is accepted (on the CPU it is already reached)
    buf.get_dispatch_layout(idx, E, previous_event=deep_ep.Buffer.capture())
    want = dc.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=2)
    for got_t, want_t, name in zip((recv_x, recv_idx, recv_w), want[:3], ("recv_x", "recv_idx", "recv_w")):
        _equal(got_t, want_t, name)
    assert isinstance(counts, list) and counts == want[3]
    assert isinstance(handle, Handle)

    # cached dispatch: (recv_x, None, None, None, None, event)
    again = buf.dispatch(x * 2, handle=handle, previous_event=deep_ep.Buffer.capture())
    assert len(again) == 6 and again[1:5] == (None, None, None, None)
    _equal(again[0], dc.dispatch(x * 2, handle=want[4])[0], "cached recv_x")
    with pytest.raises(ValueError, match="^topk_idx"):
        buf.dispatch(x, handle=handle, topk_idx=idx)

    # FP8 pair in, FP8 pair out
    pair = per_token_cast_to_fp8(x)
    got_pair = buf.dispatch(pair, num_tokens_per_expert=per_expert, topk_idx=idx)[0]
    want_pair = dc.dispatch(pair, topk_idx=idx, num_experts=E)[0]
    assert isinstance(got_pair, tuple)
    _equal(got_pair[0], want_pair[0], "fp8 values")
    _equal(got_pair[1], want_pair[1], "fp8 scales")

    # combine: 3-tuple, same results; bias added once in fp32
    y = (recv_x.float() * 0.5).to(torch.bfloat16)
    combined = buf.combine(y, handle, topk_weights=recv_w, config=deep_ep.Config(8))
    assert len(combined) == 3 and combined[2].event is None
    assert dc.num_sms == 8                   # the config's num_sms reached the deepcomm Buffer
    want_c = dc.combine(y, want[4], topk_weights=recv_w)
    _equal(combined[0], want_c[0], "combined_x")
    _equal(combined[1], want_c[1], "combined_w")
    bias = torch.full_like(x, 0.25)
    with_bias = buf.combine(y, handle, bias=(bias, bias))[0]
    _equal(with_bias, (want_c[0].float() + 0.5).to(torch.bfloat16), "combine with bias")
    assert dc.num_sms == deep_ep.Buffer.num_sms

    # num_worst_tokens: deepcomm's worst-case form, with DeepEP's empty per-expert list
    worst = buf.dispatch(x, num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, num_worst_tokens=64)
    want_worst = dc.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, num_worst_tokens=64)
    assert worst[0].shape[0] == 64 and worst[3] == []
    for got_t, want_t, name in zip(worst[:3], want_worst[:3], ("worst x", "worst idx", "worst w")):
        _equal(got_t, want_t, name)
    n = want[4].num_recv
    padded_y = torch.cat([y, torch.zeros(64 - n, HIDDEN, dtype=y.dtype)])
    _equal(buf.combine(padded_y, worst[4])[0], dc.combine(y, want[4])[0], "combine of padded rows")

    # bad input names the argument
    with pytest.raises(ValueError, match="^num_tokens_per_expert"):
        buf.dispatch(x, topk_idx=idx)
    with pytest.raises(ValueError, match="^new_num_sms"):
        deep_ep.Buffer.set_num_sms(7)
    buf.destroy()
    return True


def _low_latency_worker(rank, world):
    from deepcomm.compat import deep_ep
    from deepcomm.fp8 import pack_ue8m0
    E, M = PER_RANK * world, 16
    buf = deep_ep.Buffer(None, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(M, HIDDEN, world, E),
                         low_latency_mode=True, num_qps_per_rank=PER_RANK, hidden=HIDDEN)
    dc = buf.runtime
    x, idx, w = _inputs(rank, world, 5 + 3 * rank)
    stats = torch.zeros(PER_RANK, dtype=torch.int32)

    out = buf.low_latency_dispatch(x, idx, M, E, cumulative_local_expert_recv_stats=stats, use_fp8=True,
                                   round_scale=True, use_ue8m0=True)
    assert len(out) == 5 and out[4] is None
    (values, packed), count, handle, event, _ = out
    want_x, want_count, want_handle, _ = dc.low_latency_dispatch(x, idx, M, E, use_fp8=True, use_ue8m0=True)
    _equal(values, want_x[0], "ll values")
    _equal(count, want_count, "ll count")
    assert packed.dtype == torch.int32 and packed.shape == (PER_RANK, world * M, HIDDEN // 512)
    assert packed.stride()[1:] == (1, world * M)   # column-major in the last two dims, like DeepEP
    _equal(packed.contiguous(), pack_ue8m0(want_x[1]), "ll packed scales")
    torch.testing.assert_close(stats, want_count)

    # hook mode: the outputs are ready after hook(); bf16 without fp8
    recv, count2, handle2, _, hook = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, return_recv_hook=True)
    assert callable(hook)
    hook()
    hook()                                         # a second call is harmless
    want_bf16, _, _, _ = dc.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    _equal(recv, want_bf16, "ll bf16 recv")
    torch.testing.assert_close(stats, want_count)  # stats only added when asked

    y = buf.get_next_low_latency_combine_buffer(handle2)
    assert y.shape == recv.shape and y.dtype == torch.bfloat16
    y.copy_(recv)
    target = torch.empty(x.shape, dtype=torch.bfloat16)
    combined, event, hook = buf.low_latency_combine(y, idx, w, handle2, zero_copy=True, out=target,
                                                    async_finish=True)
    assert combined is target and hook is None
    event.current_stream_wait()
    _equal(combined, dc.low_latency_combine(recv, idx, w, handle2)[0], "ll combine")
    buf.destroy()
    return True


def test_normal_mode_matches_deepcomm():
    assert run_ranks(_normal_worker, 2) == [True, True]


def test_low_latency_matches_deepcomm():
    assert run_ranks(_low_latency_worker, 2) == [True, True]


def test_signatures_follow_deep_ep_v1():
    from deepcomm.compat import deep_ep
    B = deep_ep.Buffer

    def params(fn):
        return list(inspect.signature(fn).parameters)[2:]   # drop self and the first argument

    assert list(inspect.signature(B.__init__).parameters)[1:10] == [
        "group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
        "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "explicitly_destroy", "comm"]
    assert params(B.get_dispatch_layout) == ["num_experts", "previous_event", "async_finish",
                                             "allocate_on_comm_stream"]
    assert params(B.dispatch)[:8] == ["handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank",
                                      "is_token_in_rank", "num_tokens_per_expert", "topk_idx", "topk_weights",
                                      "expert_alignment"]
    assert params(B.combine) == ["handle", "topk_weights", "bias", "config", "previous_event", "async_finish",
                                 "allocate_on_comm_stream"]
    assert params(B.low_latency_dispatch)[:3] == ["topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts"]
    assert "return_recv_hook" in params(B.low_latency_combine)
    cfg = B.get_dispatch_config(8)
    assert isinstance(cfg, deep_ep.Config) and cfg.num_sms == B.num_sms
    assert isinstance(B.get_combine_config(16), deep_ep.Config)
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    from deepcomm.sizing import nvl_buffer_bytes
    got = nvl_buffer_bytes(8, 4096, 7168)
    assert cfg.get_nvl_buffer_size_hint(7168 * 2, 8) == (0 if got is None else got["total"])
    assert B.get_low_latency_rdma_size_hint(128, 7168, 8, 256) > 0
    with deep_ep.EventOverlap(deep_ep.EventHandle()) as ev:  # CPU: an already-reached event
        ev.current_stream_wait()
