"""Bad input raises ValueError naming the argument, before any communication.

One 2-rank job runs every case (each rank the same sequence); afterwards a valid dispatch must still work,
which shows no rejected call left a collective half done.
"""
import pytest
import torch

from tests.helpers.multiproc import run_ranks

T, H, K, E = 4, 256, 2, 8


def _ctx():
    import deepcomm
    c = type("Ctx", (), {})()
    c.dc = deepcomm
    c.buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=1024, num_max_low_latency_tokens=8, timeout_s=30)
    c.other = deepcomm.Buffer(max_tokens_per_rank=16, hidden=1024)
    gen = torch.Generator().manual_seed(0)
    c.x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    c.idx = torch.tensor([[0, 5], [3, -1], [7, 2], [-1, -1]])
    c.w = torch.rand(T, K, generator=gen)
    c.pair = deepcomm.fp8.per_token_cast_to_fp8(c.x.float())
    _, _, _, _, c.handle = c.buf.dispatch(c.x, topk_idx=c.idx, topk_weights=c.w, num_experts=E)
    _, _, _, _, c.other_handle = c.other.dispatch(c.x, topk_idx=c.idx, num_experts=E)
    c.ll_x, _, c.ll_handle, _ = c.buf.low_latency_dispatch(c.x, c.idx, 4, E, use_fp8=False)
    return c


def _dispatch(c, x=None, idx="default", w=None, experts=E, **kw):
    return c.buf.dispatch(c.x if x is None else x, topk_idx=c.idx if idx == "default" else idx,
                          topk_weights=w, num_experts=experts, **kw)


def _ll(c, x=None, idx=None, m=4, experts=E, **kw):
    return c.buf.low_latency_dispatch(c.x if x is None else x, c.idx if idx is None else idx, m, experts, **kw)


def _ll_combine(c, x=None, idx=None, w=None, handle=None, **kw):
    return c.buf.low_latency_combine(c.ll_x if x is None else x, c.idx if idx is None else idx,
                                     c.w if w is None else w, c.ll_handle if handle is None else handle, **kw)


# name -> (argument named at the start of the message, call)
CASES = {
    "x_int_dtype": ("x", lambda c: _dispatch(c, x=torch.zeros(T, H, dtype=torch.int32))),
    "x_bare_fp8": ("x", lambda c: _dispatch(c, x=c.pair[0])),
    "x_3d": ("x", lambda c: _dispatch(c, x=c.x.reshape(T, 2, 128))),
    "x_non_contiguous": ("x", lambda c: _dispatch(c, x=torch.zeros(H, T, dtype=torch.bfloat16).t())),
    "x_wrong_device": ("x", lambda c: _dispatch(c, x=torch.zeros(T, H, dtype=torch.bfloat16, device="meta"))),
    "x_hidden_not_multiple_of_8": ("x", lambda c: _dispatch(c, x=torch.zeros(T, 100, dtype=torch.bfloat16))),
    "x_hidden_over_buffer": ("x", lambda c: _dispatch(c, x=torch.zeros(T, 2048, dtype=torch.bfloat16))),
    "x_tokens_over_max": ("x", lambda c: _dispatch(c, x=torch.zeros(17, H, dtype=torch.bfloat16),
                                                   idx=torch.zeros(17, K, dtype=torch.int64))),
    "x_pair_of_three": ("x", lambda c: _dispatch(c, x=(c.pair[0], c.pair[1], c.pair[1]))),
    "x_misaligned_view": ("x", lambda c: _dispatch(c, x=torch.zeros(T * H + 1, dtype=torch.bfloat16)[1:].view(T, H))),
    "topk_idx_too_many_slots": ("topk_idx", lambda c: _dispatch(c, idx=torch.zeros(T, 33, dtype=torch.int64))),
    "ll_x_misaligned_view": ("x", lambda c: _ll(c, x=torch.zeros(T * H + 1, dtype=torch.bfloat16)[1:].view(T, H))),
    "fp8_values_not_fp8": ("x[0]", lambda c: _dispatch(c, x=(c.x, c.pair[1]))),
    "fp8_hidden_not_multiple_of_128": ("x[0]", lambda c: _dispatch(
        c, x=(torch.zeros(T, 136, dtype=torch.float8_e4m3fn), torch.ones(T, 1)))),
    "fp8_scales_wrong_shape": ("x[1]", lambda c: _dispatch(c, x=(c.pair[0], torch.ones(T, 3)))),
    "fp8_scales_wrong_dtype": ("x[1]", lambda c: _dispatch(c, x=(c.pair[0], c.pair[1].half()))),
    "fp8_packed_scales_need_512": ("x[1]", lambda c: _dispatch(c, x=(c.pair[0], torch.ones(T, 1, dtype=torch.int32)))),
    "topk_idx_int32": ("topk_idx", lambda c: _dispatch(c, idx=c.idx.int())),
    "topk_idx_rows": ("topk_idx", lambda c: _dispatch(c, idx=c.idx[:3].contiguous())),
    "topk_idx_1d": ("topk_idx", lambda c: _dispatch(c, idx=c.idx[:, 0].contiguous())),
    "topk_idx_non_contiguous": ("topk_idx", lambda c: _dispatch(c, idx=c.idx.t().contiguous().t())),
    "topk_idx_expert_too_large": ("topk_idx", lambda c: _dispatch(c, idx=torch.full((T, K), E))),
    "topk_idx_below_minus_one": ("topk_idx", lambda c: _dispatch(c, idx=torch.full((T, K), -2))),
    "topk_idx_missing": ("topk_idx", lambda c: _dispatch(c, idx=None)),
    "topk_weights_fp64": ("topk_weights", lambda c: _dispatch(c, w=c.w.double())),
    "topk_weights_shape": ("topk_weights", lambda c: _dispatch(c, w=c.w[:, :1].contiguous())),
    "num_experts_not_multiple_of_world": ("num_experts", lambda c: _dispatch(c, experts=7)),
    "num_experts_zero": ("num_experts", lambda c: _dispatch(c, experts=0)),
    "num_experts_missing": ("num_experts", lambda c: _dispatch(c, experts=None)),
    "expert_alignment_zero": ("expert_alignment", lambda c: _dispatch(c, expert_alignment=0)),
    "cached_rows_mismatch": ("x", lambda c: c.buf.dispatch(c.x[:3].contiguous(), handle=c.handle)),
    "cached_num_experts_mismatch": ("num_experts", lambda c: c.buf.dispatch(c.x, handle=c.handle, num_experts=16)),
    "combine_handle_other_buffer": ("handle", lambda c: c.buf.combine(c.x, c.other_handle)),
    "combine_handle_wrong_type": ("handle", lambda c: c.buf.combine(c.x, c.ll_handle)),
    "combine_rows_mismatch": ("x", lambda c: c.buf.combine(
        torch.zeros(c.handle.num_recv + 1, H, dtype=torch.bfloat16), c.handle)),
    "combine_fp8_pair": ("x", lambda c: c.buf.combine(c.pair, c.handle)),
    "combine_use_fp8_not_bool": ("use_fp8", lambda c: c.buf.combine(
        torch.zeros(c.handle.num_recv, H, dtype=torch.bfloat16), c.handle, use_fp8=1)),
    "combine_fp8_x_not_bf16": ("x", lambda c: c.buf.combine(  # fp32 is a valid x without use_fp8 (reference)
        torch.zeros(c.handle.num_recv, H), c.handle, use_fp8=True)),
    "combine_fp8_hidden_not_multiple_of_128": ("x", lambda c: c.buf.combine(  # 136 is fine without use_fp8
        torch.zeros(c.handle.num_recv, 136, dtype=torch.bfloat16), c.handle, use_fp8=True)),
    "combine_weights_rows": ("topk_weights", lambda c: c.buf.combine(
        torch.zeros(c.handle.num_recv, H, dtype=torch.bfloat16), c.handle,
        topk_weights=torch.zeros(c.handle.num_recv + 1, K))),
    "ll_x_not_bf16": ("x", lambda c: _ll(c, x=c.x.float())),
    "ll_tokens_over_m": ("x", lambda c: _ll(c, m=3)),
    "ll_m_over_buffer_cap": ("num_max_dispatch_tokens_per_rank", lambda c: _ll(c, m=9)),
    "ll_hidden_not_multiple_of_128": ("x", lambda c: _ll(c, x=torch.zeros(T, 136, dtype=torch.bfloat16))),
    "ll_duplicate_experts": ("topk_idx", lambda c: _ll(c, idx=torch.tensor([[1, 1], [0, 2], [3, 4], [5, 6]]))),
    "ll_ue8m0_without_fp8": ("use_ue8m0", lambda c: _ll(c, use_fp8=False, use_ue8m0=True)),
    "ll_hook_flag_not_bool": ("return_recv_hook", lambda c: _ll(c, return_recv_hook=1)),
    "ll_combine_x_shape": ("x", lambda c: _ll_combine(c, x=c.ll_x[:, :-1].contiguous())),
    "ll_combine_weights_shape": ("topk_weights", lambda c: _ll_combine(c, w=c.w[:2].contiguous())),
    "ll_combine_topk_idx_dtype": ("topk_idx", lambda c: _ll_combine(c, idx=c.idx.int())),
    "ll_combine_wrong_handle": ("handle", lambda c: _ll_combine(c, handle=c.handle)),
    "layout_num_experts": ("num_experts", lambda c: c.buf.get_dispatch_layout(c.idx, 9)),
    "layout_topk_idx_float": ("topk_idx", lambda c: c.buf.get_dispatch_layout(c.idx.float(), E)),
    "set_num_sms_zero": ("num_sms", lambda c: c.buf.set_num_sms(0)),
    "buffer_num_sms_zero": ("num_sms", lambda c: c.dc.Buffer(num_sms=0)),
    "buffer_bad_backend": ("backend", lambda c: c.dc.Buffer(backend="tpu")),
    "buffer_negative_timeout": ("timeout_s", lambda c: c.dc.Buffer(timeout_s=-1.0)),
    "buffer_hidden_not_multiple_of_8": ("hidden", lambda c: c.dc.Buffer(hidden=100)),
    "buffer_max_tokens_zero": ("max_tokens_per_rank", lambda c: c.dc.Buffer(max_tokens_per_rank=0)),
}


def _validation_worker(rank, world):
    c = _ctx()
    seen = {}
    for name, (_, call) in CASES.items():
        try:
            call(c)
            seen[name] = ("no error", "")
        except Exception as exc:  # noqa: BLE001 - the test reports whatever came out
            seen[name] = (type(exc).__name__, str(exc))
    # nothing above communicated: the group is still in step
    recv_x, _, _, _, handle = _dispatch(c)
    combined, _ = c.buf.combine(recv_x, handle)
    copies = handle.is_token_in_rank.sum(1, keepdim=True).float()
    assert torch.equal(combined, (c.x.float() * copies).to(torch.bfloat16))
    # backend selection on a CPU gloo group
    try:
        c.dc.Buffer(backend="cuda")
        seen["cuda_backend"] = ("no error", "")
    except Exception as exc:  # noqa: BLE001
        seen["cuda_backend"] = (type(exc).__name__, str(exc))
    seen["auto_backend"] = c.dc.Buffer(backend="auto").backend_name
    return seen


@pytest.fixture(scope="module")
def outcomes():
    per_rank = run_ranks(_validation_worker, 2)
    kinds = [{name: out[0] if isinstance(out, tuple) else out for name, out in r.items()} for r in per_rank]
    assert kinds[0] == kinds[1]
    return per_rank[0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_rejects_bad_input(outcomes, case):
    kind, message = outcomes[case]
    arg = CASES[case][0]
    assert kind == "ValueError", f"{case}: expected ValueError, got {kind}: {message}"
    assert message.startswith(arg + ":"), f"{case}: message does not start with {arg!r}: {message}"


def test_cuda_backend_refused_with_reason_and_auto_falls_back(outcomes):
    kind, message = outcomes["cuda_backend"]
    assert kind == "RuntimeError" and "cuda" in message.lower()
    assert outcomes["auto_backend"] == "reference"


def test_duplicate_check_names_the_first_offending_row():
    from deepcomm import validation as v
    idx = torch.tensor([[0, 1], [2, 3], [4, 4], [5, 5]])
    with pytest.raises(ValueError, match=r"topk_idx: row 2 names the same expert twice"):
        v.check_topk_idx(idx, 4, 8, torch.device("cpu"), forbid_duplicates=True)
    ok = torch.tensor([[0, -1], [-1, -1], [3, 4]])  # repeated -1 slots are not duplicates
    assert v.check_topk_idx(ok, 3, 8, torch.device("cpu"), forbid_duplicates=True) is ok
