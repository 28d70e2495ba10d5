"""Code written the way DeepEP V1's users write it, run through ``import deep_ep`` after ``install_deep_ep()``.

Each function is one rank's part of a client: DeepEP's own test flows (intranode, low-latency, normal-mode buffer
reused for low-latency), a training framework's autograd wrappers (events made with ``EventOverlap(EventHandle())``,
buffers sized from the config hints) and an inference engine's low-latency pattern (hooks or events, FP8 with
per-token scales). The checks are what DeepEP documents: receive counts from a global all-reduce of the layout,
rows grouped by source rank as the handle's prefix matrix says, combine summing without weights in normal mode and
with them in low-latency mode, the packed ``[L, R*M, H]`` layout with ``layout_range = begin << 32 | count``.

The functions take a device and a backend, so the CPU tests (reference backend, gloo) and the GPU tests (CUDA
backend) run the same client code.
"""
from __future__ import annotations

import random

import torch
import torch.distributed as dist


# ---- helpers a DeepEP client writes for itself ----------------------------------------------------------------
def relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """1 - cosine-style similarity of (a + 1) and (b + 1), in float64: 0 for equal tensors."""
    a, b = a.double() + 1, b.double() + 1
    return float(1 - 2 * (a * b).sum() / (a * a + b * b).sum())


def cast_to_fp8(x: torch.Tensor):
    """Per 128-column block e4m3 values and fp32 scales ``[T, H/128]`` (amax / 448)."""
    t, h = x.shape
    blocks = x.float().view(t, h // 128, 128)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    values = (blocks * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(t, h)
    return values, amax / 448.0


def cast_back(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bf16 from e4m3 values and fp32 scales ``[T, G]`` or UE8M0 exponent bytes packed in int32 ``[T, G/4]``."""
    t, h = values.shape
    if scales.dtype == torch.int32:
        # flattened first: a [*, 1] tensor can pass as contiguous with a last stride that is not 1
        scales = (scales.contiguous().reshape(-1).view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
    scales = scales.reshape(t, -1)
    per = h // scales.shape[1]
    return (values.float().view(t, scales.shape[1], per) * scales.unsqueeze(2)).view(t, h).to(torch.bfloat16)


def distinct_ranks(dest: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Each row's distinct non-negative values, largest first, padded with -1 (a token's destination ranks)."""
    out = torch.full((dest.shape[0], num_slots), -1, dtype=torch.int64, device=dest.device)
    for t in range(dest.shape[0]):
        ranks = sorted({int(v) for v in dest[t].tolist() if v >= 0}, reverse=True)
        out[t, :len(ranks)] = torch.tensor(ranks, dtype=torch.int64)
    return out


def own_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """The layout a client computes by hand: tokens per rank, per expert, and the token-in-rank mask."""
    per_rank = num_experts // num_ranks
    dest = (topk_idx // per_rank).masked_fill(topk_idx < 0, -1)
    dest = distinct_ranks(dest, num_ranks)
    in_rank = torch.zeros(topk_idx.shape[0], num_ranks, dtype=torch.bool, device=topk_idx.device)
    for r in range(num_ranks):
        in_rank[:, r] = (dest == r).any(dim=1)
    per_rank_count = in_rank.sum(dim=0).to(torch.int32)
    per_expert = torch.stack([(topk_idx == e).sum() for e in range(num_experts)]).to(torch.int32)
    return per_rank_count, per_expert, in_rank


def all_reduced(t: torch.Tensor, group) -> torch.Tensor:
    # through the CPU: the group may be gloo (shared-GPU runs) with the tensors on a GPU
    host = t.cpu().clone()
    dist.all_reduce(host, group=group)
    return host.to(t.device)


def all_gathered(t: torch.Tensor, group):
    host = t.cpu().contiguous()
    parts = [torch.empty_like(host) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, host, group=group)
    return [p.to(t.device) for p in parts]


# ---- DeepEP's intranode flow ------------------------------------------------------------------------------------
def intranode_flow(deep_ep, buffer, group, device, num_tokens=40, hidden=256, num_topk=4, num_experts=None,
                   num_sms=24, gpus_per_node=None):
    """DeepEP's normal-mode sequence: layout, then for previous-event x async x payload x top-k every dispatch
    form (fresh, worst-case padded, cached) and combine, then a tuning sweep over configs. ``gpus_per_node`` below
    the world size: DeepEP's internode test instead (per-node counts, the internode handle's prefix sums)."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    num_experts = num_experts or 8 * num_ranks
    torch.manual_seed(rank)
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16, device=device) * rank
    x_rand = torch.randn((num_tokens, hidden), dtype=torch.bfloat16, device=device)
    values, scales = cast_to_fp8(x)
    x_fp8 = (values, scales.T.contiguous().T)            # column-major scales, as DeepEP's test passes them
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32, device=device).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=False)[1].to(deep_ep.topk_idx_t)
    topk_weights = torch.ones((num_tokens, num_topk), dtype=torch.float32, device=device) * rank
    topk_weights_rand = torch.randn((num_tokens, num_topk), dtype=torch.float32, device=device)

    per_rank, per_expert, in_rank = own_layout(topk_idx, num_experts, num_ranks)
    global_per_rank = all_reduced(per_rank, group)
    global_per_expert = all_reduced(per_expert, group)
    ref_per_rank, ref_per_rdma_rank, ref_per_expert, ref_in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    assert torch.equal(ref_per_rank, per_rank) and ref_per_rank.dtype == torch.int32
    assert torch.equal(ref_per_expert, per_expert) and ref_per_expert.dtype == torch.int32
    assert torch.equal(ref_in_rank, in_rank) and ref_in_rank.dtype == torch.bool
    internode = gpus_per_node is not None and gpus_per_node < num_ranks
    # what the Buffer spans, asked the way frameworks ask DeepEP's runtime
    assert buffer.runtime.is_available()
    assert buffer.runtime.get_num_rdma_ranks() == (num_ranks // gpus_per_node if internode else 1)
    assert buffer.runtime.get_rdma_rank() == (rank // gpus_per_node if internode else 0)
    dev = torch.device(device)
    want_device = -1 if dev.type != "cuda" else (torch.cuda.current_device() if dev.index is None else dev.index)
    assert buffer.runtime.get_local_device_id() == want_device
    if internode:
        num_nodes = num_ranks // gpus_per_node
        per_node = in_rank.view(num_tokens, num_nodes, gpus_per_node).any(dim=2).sum(dim=0).to(torch.int32)
        assert torch.equal(ref_per_rdma_rank, per_node)
        config = deep_ep.Config(num_sms, 8, 512, 16, 128)
    else:
        assert ref_per_rdma_rank is None
        config = deep_ep.Config(num_sms, 8, 256)
    group.barrier()

    def source_ends(handle):
        # intranode: the rank prefix matrix (item 0, [R, R]); internode: recv_gbl_rank_prefix_sum (item -4, [R])
        return handle[-4].tolist() if internode else [int(handle[0][s][rank].item()) for s in range(num_ranks)]

    def check_rows(rows, handle):
        # every row is constant; rows [end of s-1, end of s) came from rank s
        assert torch.equal(rows.amin(dim=1), rows.amax(dim=1))
        start = 0
        for s, end in enumerate(source_ends(handle)):
            assert (rows[start:end].int() - s).abs().sum().item() == 0, (s, start, end)
            start = end

    tried = 0
    for previous_mode in (False, True):
        for async_mode in (False, True):
            for current_x in (x_rand, x, x_fp8):
                for with_topk in (False, True):
                    tried += 1
                    is_rand = current_x is x_rand
                    args = {"x": current_x, "num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank,
                            "num_tokens_per_expert": per_expert, "config": config, "async_finish": async_mode}
                    if internode:
                        args["num_tokens_per_rdma_rank"] = ref_per_rdma_rank
                    if with_topk:
                        args.update({"topk_idx": topk_idx,
                                     "topk_weights": topk_weights_rand if is_rand else topk_weights})
                    if previous_mode:
                        args["previous_event"] = buffer.capture()
                    recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event = buffer.dispatch(**args)
                    if async_mode:
                        event.current_stream_wait()
                    recv_x = cast_back(*recv_x) if isinstance(recv_x, tuple) else recv_x

                    assert len(handle) == (10 if internode else 6)
                    assert recv_x.size(0) == int(global_per_rank[rank].item())
                    assert isinstance(counts, list)
                    assert global_per_expert.view(num_ranks, -1)[rank].tolist() == counts
                    if not is_rand:
                        check_rows(recv_x, handle)
                    weights_before_fill = None
                    if with_topk:
                        local = num_experts // num_ranks
                        assert (recv_topk_idx.eq(-1) | ((recv_topk_idx >= 0) & (recv_topk_idx < local))).all()
                        for e, c in enumerate(counts):
                            assert recv_topk_idx.eq(e).sum().item() == c
                        weights_before_fill = recv_topk_weights.clone()
                        if not is_rand:
                            # slots of other ranks' experts: fill with the row's value, then each row is constant
                            filler = recv_topk_weights.amax(dim=1, keepdim=True).expand_as(recv_topk_weights)
                            recv_topk_weights[recv_topk_idx.eq(-1)] = filler[recv_topk_idx.eq(-1)]
                            check_rows(recv_topk_weights, handle)
                        else:
                            assert (weights_before_fill[recv_topk_idx.eq(-1)] == 0).all()

                        # padded to a fixed count: no list, rows beyond the real ones have no experts
                        worst = num_tokens * num_ranks
                        w_x, w_idx, w_w, empty, _, w_event = buffer.dispatch(**dict(args, num_worst_tokens=worst))
                        if async_mode:
                            w_event.current_stream_wait()
                        w_x = cast_back(*w_x) if isinstance(w_x, tuple) else w_x
                        assert len(empty) == 0
                        assert w_x.size(0) == w_idx.size(0) == w_w.size(0) == worst
                        n = recv_x.size(0)
                        assert torch.equal(w_x[:n], recv_x) and torch.equal(w_idx[:n], recv_topk_idx)
                        assert torch.equal(w_w[:n], weights_before_fill)
                        assert (w_idx[n:] == -1).all()
                    else:
                        cached_args = {"x": current_x, "handle": handle, "config": config,
                                       "async_finish": async_mode}
                        if previous_mode:
                            cached_args["previous_event"] = buffer.capture()
                        again, none_1, none_2, none_3, none_4, c_event = buffer.dispatch(**cached_args)
                        assert (none_1, none_2, none_3, none_4) == (None, None, None, None)
                        if async_mode:
                            c_event.current_stream_wait()
                        again = cast_back(*again) if isinstance(again, tuple) else again
                        if not is_rand:
                            check_rows(again, handle)
                        assert torch.equal(again, recv_x)

                    combine_args = {"x": recv_x, "handle": handle, "config": config, "async_finish": async_mode}
                    if with_topk:
                        combine_args["topk_weights"] = recv_topk_weights
                    if previous_mode:
                        combine_args["previous_event"] = buffer.capture()
                    combined_x, combined_w, c_event = buffer.combine(**combine_args)
                    if async_mode:
                        c_event.current_stream_wait()
                    copies = in_rank.sum(dim=1).unsqueeze(1)
                    ref_x = x_rand if is_rand else x
                    assert relative_diff(combined_x.float() / copies, ref_x) < 5e-6
                    if with_topk:
                        got_w = combined_w if is_rand else combined_w / copies
                        ref_w = topk_weights_rand if is_rand else topk_weights
                        assert relative_diff(got_w, ref_w) < 1e-9
                    else:
                        assert combined_w is None

    # combine with one and two biases, added to the sum
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, config=config)
    bias_0 = torch.ones((num_tokens, hidden), dtype=torch.bfloat16, device=device)
    bias_1 = torch.randn((num_tokens, hidden), dtype=torch.bfloat16, device=device)
    combined, _, _ = buffer.combine(recv_x, handle, bias=(bias_0, bias_1), config=config)
    copies = in_rank.sum(dim=1).unsqueeze(1)
    assert relative_diff((combined.float() - bias_0.float() - bias_1.float()) / copies, x) < 5e-6

    # the tuning sweep: explicit chunk sizes, and the default config after Buffer.set_num_sms
    for payload in (x_fp8, x):
        for chunk in (4, 8, 0):
            if chunk and internode:
                cfg = deep_ep.Config(num_sms, chunk, 512, chunk, 128)
            elif chunk:
                cfg = deep_ep.Config(num_sms, chunk, 256)
            else:
                deep_ep.Buffer.set_num_sms(num_sms)
                cfg = deep_ep.Buffer.get_dispatch_config(num_ranks)
            out = buffer.dispatch(x=payload, handle=handle, config=cfg)[0]
            out = cast_back(*out) if isinstance(out, tuple) else out
            check_rows(out, handle)
    for chunk in (1, 4, 0):
        if chunk:
            cfg = deep_ep.Config(num_sms, chunk, 512, chunk, 128) if internode else deep_ep.Config(num_sms, chunk, 256)
        else:
            deep_ep.Buffer.set_num_sms(num_sms)
            cfg = deep_ep.Buffer.get_combine_config(num_ranks)
        combined = buffer.combine(x=recv_x, handle=handle, config=cfg)[0]
        assert relative_diff(combined.float() / copies, x) < 5e-6
    return tried


# ---- DeepEP's low-latency flow ----------------------------------------------------------------------------------
def low_latency_flow(deep_ep, buffer, group, device, num_tokens=16, hidden=512, num_topk=4, num_experts=None,
                     seed=0, formats=None):
    """DeepEP's low-latency sequence: for hook x FP8 x round_scale x UE8M0, dispatch (once or twice), check each
    local expert's packed rows against every rank's top-k, then combine with and without zero-copy into ``out``."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    num_experts = num_experts or 4 * num_ranks
    num_local = num_experts // num_ranks
    torch.manual_seed(seed + rank)
    rnd = random.Random(seed + rank)
    offset = 128
    x = torch.ones((num_tokens, hidden), dtype=torch.bfloat16, device=device) * (rank - offset)
    x[:, -128:] = torch.arange(num_tokens, device=device).to(torch.bfloat16).view(-1, 1)
    scores = torch.randn((num_tokens, num_experts), dtype=torch.float32, device=device).abs() + 1
    topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=True)[1].to(deep_ep.topk_idx_t)
    topk_weights = torch.randn((num_tokens, num_topk), dtype=torch.float32, device=device).abs()
    for _ in range(3):
        topk_idx[rnd.randrange(num_tokens), rnd.randrange(num_topk)] = -1
    all_topk_idx = torch.stack(all_gathered(topk_idx, group))

    if formats is None:
        formats = [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]
    checked = 0
    for return_recv_hook in (False, True):
        for use_fp8, round_scale, use_ue8m0 in formats:
            for repeat in range(1 + checked % 2):
                stats = torch.zeros((num_local,), dtype=torch.int, device=device)
                packed_x, packed_count, handle, event, hook = buffer.low_latency_dispatch(
                    x, topk_idx, num_tokens, num_experts, use_fp8=use_fp8, round_scale=round_scale,
                    use_ue8m0=use_ue8m0, cumulative_local_expert_recv_stats=stats,
                    async_finish=not return_recv_hook, return_recv_hook=return_recv_hook)
                if return_recv_hook:
                    assert event.event is None
                    hook()
                else:
                    assert hook is None
                    event.current_stream_wait()
            checked += 1
            if use_fp8:
                values, scales = packed_x
                assert values.shape == (num_local, num_ranks * num_tokens, hidden)
                assert values.dtype == torch.float8_e4m3fn
                want = (torch.int32, hidden // 512) if use_ue8m0 else (torch.float32, hidden // 128)
                assert (scales.dtype, scales.shape[2]) == want and scales.shape[:2] == values.shape[:2]
                # column-major in the last two dimensions
                assert scales.stride(1) == 1 and scales.stride(2) == num_ranks * num_tokens
                packed_x = (values, scales.contiguous())
                gemm_in = cast_back(values.view(-1, hidden),
                                    packed_x[1].view(-1, packed_x[1].shape[2])).view(values.shape)
            else:
                assert packed_x.shape == (num_local, num_ranks * num_tokens, hidden)
                assert packed_x.dtype == torch.bfloat16
                gemm_in = packed_x.clone()
            assert packed_count.dtype == torch.int32 and packed_count.shape == (num_local,)
            src_info_all, layout_range_all = handle[0], handle[1]
            assert tuple(handle[2:]) == (num_tokens, hidden, num_experts)
            for e in range(num_local):
                expert = rank * num_local + e
                got = cast_back(packed_x[0][e], packed_x[1][e]) if use_fp8 else packed_x[e]
                count, src_info, layout_range = packed_count[e], src_info_all[e], layout_range_all[e]
                n = int(count.item())
                assert int(stats[e].item()) == n
                assert n == int((layout_range & 0xFFFFFFFF).sum().item())
                assert n == int((all_topk_idx == expert).sum().item())
                if n == 0:
                    continue
                got = got[:n]
                low = got[:, :-128].amin(dim=-1)
                assert torch.equal(low, got[:, :-128].amax(dim=-1))
                if round_scale:
                    assert relative_diff(got[:, -1], src_info[:n].view(-1)) < 0.007
                else:
                    assert (got[:, -128:] - src_info[:n].view(-1, 1) % num_tokens).abs().sum().item() == 0
                for s in range(num_ranks):
                    begin = int((layout_range[s] >> 32).item())
                    cnt = int((layout_range[s] & 0xFFFFFFFF).item())
                    if not round_scale:
                        assert int((low == s - offset).sum().item()) == int((all_topk_idx[s] == expert).sum().item())
                        assert (got[begin:begin + cnt, :-128] - s + offset).abs().sum().item() == 0

            for zero_copy in (False, True):
                if zero_copy:
                    buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = gemm_in
                out = torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=device)
                # zero-copy: the outputs are read from that buffer, x is not (NaN here to tell)
                x_arg = torch.full_like(gemm_in, float("nan")) if zero_copy else gemm_in
                combined, event, hook = buffer.low_latency_combine(
                    x_arg, topk_idx, topk_weights, handle, async_finish=not return_recv_hook,
                    zero_copy=zero_copy, return_recv_hook=return_recv_hook, out=out)
                if return_recv_hook:
                    hook()
                else:
                    event.current_stream_wait()
                assert combined is out
                want = x * topk_weights.masked_fill(topk_idx == -1, 0).sum(dim=1).view(-1, 1)
                assert not torch.isnan(combined).any()
                if not round_scale:
                    assert relative_diff(want, combined) < (9e-4 if use_fp8 else 1e-5)
    return checked


def deep_ep_test_buffer(deep_ep, group, mode, num_tokens=16, hidden=512, num_experts=None, **extra):
    """A Buffer built as DeepEP's tests build one: 'normal' (intranode test), 'low_latency', or 'both' (the
    intranode test's low-latency compatibility buffer)."""
    num_ranks = dist.get_world_size(group)
    num_experts = num_experts or 4 * num_ranks
    if mode == "normal":
        return deep_ep.Buffer(group, int(2e9), 0, low_latency_mode=False, num_qps_per_rank=1,
                              explicitly_destroy=True, allow_mnnvl=False, use_fabric=False, **extra)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks, num_experts)
    if mode == "low_latency":
        return deep_ep.Buffer(group, num_rdma_bytes=rdma, low_latency_mode=True,
                              num_qps_per_rank=num_experts // num_ranks, allow_nvlink_for_low_latency_mode=True,
                              explicitly_destroy=True, allow_mnnvl=False, enable_shrink=False, **extra)
    return deep_ep.Buffer(group, int(2e9), rdma, low_latency_mode=True, num_qps_per_rank=num_experts // num_ranks,
                          explicitly_destroy=True, allow_mnnvl=False, use_fabric=False, **extra)


# ---- a training framework's autograd wrappers ---------------------------------------------------------------------
_framework_buffer = None


def framework_buffer(deep_ep, group, hidden_bytes, **extra):
    """One Buffer per group, sized by the larger of the dispatch and combine configs' hints, replaced when too
    small (how training frameworks keep theirs)."""
    global _framework_buffer
    nvl, rdma = 0, 0
    for cfg in (deep_ep.Buffer.get_dispatch_config(group.size()), deep_ep.Buffer.get_combine_config(group.size())):
        nvl = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, group.size()), nvl)
        rdma = max(cfg.get_rdma_buffer_size_hint(hidden_bytes, group.size()), rdma)
    b = _framework_buffer
    if b is None or b.group != group or b.num_nvl_bytes < nvl or b.num_rdma_bytes < rdma:
        _framework_buffer = deep_ep.Buffer(group, nvl, rdma, **extra)
    return _framework_buffer


def autograd_ops(deep_ep):
    """Dispatch and combine as autograd Functions: each waits for an event made from the current stream and
    hands DeepEP's handle from forward to backward."""
    from deep_ep.utils import EventHandle, EventOverlap

    class Dispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, idx, probs, num_experts, buffer, async_finish):
            prev = EventOverlap(EventHandle()) if async_finish else None
            per_rank, per_rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(
                idx, num_experts, previous_event=prev, async_finish=async_finish,
                allocate_on_comm_stream=async_finish)
            recv_x, recv_idx, recv_probs, counts, handle, after = buffer.dispatch(
                x, topk_idx=idx, topk_weights=probs, num_tokens_per_rank=per_rank,
                num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                previous_event=event, async_finish=async_finish, allocate_on_comm_stream=async_finish)
            if async_finish:
                after.current_stream_wait()
            ctx.buffer, ctx.handle, ctx.async_finish = buffer, handle, async_finish
            return recv_x, recv_idx, recv_probs, torch.tensor(counts), handle

        @staticmethod
        def backward(ctx, grad_x, _grad_idx, grad_probs, _grad_counts, _grad_handle):
            prev = EventOverlap(EventHandle()) if ctx.async_finish else None
            grad_in, grad_p, after = ctx.buffer.combine(
                grad_x.contiguous(), ctx.handle, topk_weights=grad_probs.float(), previous_event=prev,
                async_finish=ctx.async_finish, allocate_on_comm_stream=ctx.async_finish)
            if ctx.async_finish:
                after.current_stream_wait()
            return grad_in, None, grad_p, None, None, None

    class Combine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, buffer, handle, async_finish):
            prev = EventOverlap(EventHandle()) if async_finish else None
            out, _, after = buffer.combine(x, handle=handle, async_finish=async_finish, previous_event=prev,
                                           allocate_on_comm_stream=async_finish)
            if async_finish:
                after.current_stream_wait()
            ctx.buffer, ctx.handle, ctx.async_finish = buffer, handle, async_finish
            return out

        @staticmethod
        def backward(ctx, grad):
            prev = EventOverlap(EventHandle()) if ctx.async_finish else None
            grad_x, _, _, _, _, after = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle,
                                                            previous_event=prev, async_finish=ctx.async_finish,
                                                            allocate_on_comm_stream=ctx.async_finish)
            if ctx.async_finish:
                after.current_stream_wait()
            return grad_x, None, None, None

    return Dispatch, Combine


def training_step(deep_ep, group, device, async_finish, num_tokens=24, hidden=256, num_topk=3, extra=None):
    """A toy MoE layer: dispatch, scale each row by its expert's factor times its weight, combine; forward and
    gradients checked against the same computation done on every rank's data locally."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    num_experts = 4 * num_ranks
    local = num_experts // num_ranks
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(num_tokens, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:num_topk] for _ in range(num_tokens)]).to(device)
    probs = torch.rand(num_tokens, num_topk, generator=gen).to(device)
    factor = torch.arange(1, num_experts + 1, dtype=torch.float32, device=device) / num_experts
    x.requires_grad_()
    probs.requires_grad_()
    buffer = framework_buffer(deep_ep, group, x.size(1) * max(x.element_size(), 2), **(extra or {}))
    Dispatch, Combine = autograd_ops(deep_ep)
    recv_x, recv_idx, recv_probs, counts, handle = Dispatch.apply(x, idx, probs, num_experts, buffer, async_finish)
    assert counts.dtype == torch.int64 and counts.shape == (local,)
    assert int(counts.sum()) == int((recv_idx >= 0).sum())
    # each row: sum over its local slots of weight * expert factor, times the row
    slot_factor = torch.where(recv_idx >= 0, factor[rank * local + recv_idx.clamp(min=0)], torch.zeros_like(recv_probs))
    scale = (recv_probs * slot_factor).sum(dim=1, keepdim=True)
    y = (recv_x.float() * scale).to(torch.bfloat16)
    out = Combine.apply(y, buffer, handle, async_finish)
    loss = (out.float() * torch.linspace(0.5, 1.5, hidden, device=device)).sum()
    loss.backward()

    # the same layer on this rank's tokens alone: every top-k slot's expert applies, wherever it lives
    xr = x.detach().float().requires_grad_()
    pr = probs.detach().clone().requires_grad_()
    want = xr * (pr * factor[idx]).sum(dim=1, keepdim=True)
    (want * torch.linspace(0.5, 1.5, hidden, device=device)).sum().backward()
    assert relative_diff(out.float(), want.detach()) < 1e-4
    assert relative_diff(x.grad.float(), xr.grad) < 1e-4
    assert relative_diff(probs.grad, pr.grad) < 1e-4
    return True


# ---- an inference engine's low-latency and FP8 patterns ------------------------------------------------------------
def inference_decode_step(deep_ep, group, device, return_recv_hook, num_tokens=8, hidden=512, num_topk=2,
                          extra=None):
    """Decode: a low-latency buffer from the size hint, replaced when too small; dispatch split in a send and a
    receive half (hook, or event when no hook), experts applied on the packed rows, combine likewise."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    num_experts = 2 * num_ranks
    max_tokens = 16
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, num_ranks, num_experts)
    buffer = deep_ep.Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=num_experts // num_ranks,
                            **(extra or {}))
    assert buffer.low_latency_mode and buffer.num_rdma_bytes >= rdma and buffer.group == group
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(num_tokens, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:num_topk] for _ in range(num_tokens)]).to(device)
    w = torch.rand(num_tokens, num_topk, generator=gen).to(device)
    buffer.clean_low_latency_buffer(max_tokens, hidden, num_experts)
    recv, recv_count, handle, event, hook = buffer.low_latency_dispatch(
        x, idx, max_tokens, num_experts, use_fp8=False, async_finish=not return_recv_hook,
        return_recv_hook=return_recv_hook)
    hook() if return_recv_hook else event.current_stream_wait()
    local_factor = torch.arange(1, num_experts // num_ranks + 1, dtype=torch.float32, device=device) + rank
    expert_out = (recv.float() * local_factor.view(-1, 1, 1)).to(torch.bfloat16)
    try:  # zero-copy reads the buffer of get_next_low_latency_combine_buffer, not called yet on this Buffer
        buffer.low_latency_combine(expert_out, idx, w, handle, zero_copy=True)
        raise AssertionError("zero_copy=True without get_next_low_latency_combine_buffer was accepted")
    except ValueError as exc:
        assert str(exc).startswith("zero_copy"), exc
    combined, event, hook = buffer.low_latency_combine(expert_out, idx, w, handle,
                                                       async_finish=not return_recv_hook,
                                                       return_recv_hook=return_recv_hook)
    hook() if return_recv_hook else event.current_stream_wait()
    # expert e lives on rank e // L as local expert e % L: factor (e % L + 1) + e // L
    per_rank = num_experts // num_ranks
    factor = (idx % per_rank + 1 + idx // per_rank).float()
    want = x.float() * (w * factor).sum(dim=1, keepdim=True)
    assert relative_diff(combined.float(), want) < 1e-4
    buffer.destroy()
    return True


def fp8_prefill_step(deep_ep, group, device, scale_columns, num_tokens=20, hidden=512, extra=None):
    """Prefill with FP8 activations whose scales are per token ([T, 1]) or per 128-column block, passed as a
    (values, scales) pair; combine of the dequantised rows. ``scale_columns``: 1 or hidden // 128."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    num_experts = 4 * num_ranks
    gen = torch.Generator().manual_seed(31 + rank)
    x = torch.randn(num_tokens, hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:2] for _ in range(num_tokens)]).to(device)
    w = torch.rand(num_tokens, 2, generator=gen).to(device)
    block = hidden // scale_columns
    amax = x.float().view(num_tokens, scale_columns, block).abs().amax(dim=2).clamp(min=1e-4)
    scales = amax / 448.0
    values = (x.float().view(num_tokens, scale_columns, block) / scales.unsqueeze(2)).to(torch.float8_e4m3fn)
    values = values.view(num_tokens, hidden)
    buffer = deep_ep.Buffer(group, int(1e9), 0, **(extra or {}))
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
    (recv_values, recv_scales), recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        (values, scales), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    assert recv_scales.shape == (recv_values.shape[0], scale_columns) and recv_scales.dtype == torch.float32
    assert recv_values.dtype == torch.float8_e4m3fn and sum(counts) == int((recv_idx >= 0).sum())
    rows = cast_back(recv_values, recv_scales)
    combined, _, _ = buffer.combine(rows, handle)
    want = cast_back(values, scales).float() * in_rank.sum(dim=1, keepdim=True)
    assert relative_diff(combined.float(), want) < 1e-5
    buffer.destroy()
    return True
