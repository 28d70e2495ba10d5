"""Differentiable dispatch and combine, and the low-latency calls: the same results as the Buffer's calls. Traced
by torch.compile, they run on the operators of deepcomm/custom_ops.py (docs/api.md, "torch.compile"); in eager
mode dispatch and combine are the Buffer calls under autograd (deepcomm/eager_ops.py), with the same backward,
and the low-latency calls the Buffer calls themselves.

dispatch and combine are adjoint linear maps along one route, so each one's backward is the other:
- dispatch backward: combine the gradients of recv_x (and of recv_topk_weights, masked to the slots that
  were local at the receiver, the only ones dispatch forwarded) back to the source tokens.
- combine backward: re-dispatch the gradients along the cached handle; every copy of a token receives the
  token's gradient (topk_weights too: combine summed all of them).
FP8 pairs are not differentiable. The low-latency calls have no autograd (docs/api.md, "Low-latency mode").
"""
from __future__ import annotations

from typing import Optional

import torch

from . import custom_ops as c
from . import eager_ops
from . import validation as v
from .handle import Handle, LowLatencyHandle

_ops = torch.ops.deepcomm


def handle_args(handle: Handle) -> tuple:
    """``handle`` as the operators' ``HANDLE_SCHEMA`` arguments."""
    counts = handle.num_recv_tokens_per_expert
    worst_case = torch.is_tensor(counts)
    if not worst_case:
        counts = handle.per_expert_tensor
        if counts is None:
            counts = torch.tensor(handle.num_recv_tokens_per_expert, dtype=torch.int32)
    return (handle.is_token_in_rank, handle.send_pos, handle.count_matrix, handle.recv_src_idx, counts,
            handle.node_count_matrix, handle.num_experts, handle.hidden, worst_case)


def _check_handle(buf, handle) -> None:
    v.check_handle(handle, Handle, buf.buffer_id)
    if not torch.compiler.is_compiling():
        c.remember_route(handle)  # a handle of buf.dispatch itself (made inside a compiled graph: already known)


def _tensor_arg(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        v.fail(name, f"expected a torch.Tensor, got {type(t).__name__}")


# ---- normal dispatch ---------------------------------------------------------------------------------------
def dispatch(buf, x, topk_idx, topk_weights=None, num_experts: Optional[int] = None, expert_alignment: int = 1,
             num_worst_tokens: int = 0):
    """Differentiable ``buf.dispatch``; returns ``(recv_x, recv_topk_idx, recv_topk_weights,
    num_recv_tokens_per_expert, handle)``. Gradients flow to ``x`` and ``topk_weights`` (not for an FP8 pair)."""
    is_pair = isinstance(x, (tuple, list))
    if is_pair and len(x) != 2:
        v.fail("x", f"an FP8 input must be a (values, scales) pair, got {len(x)} items")
    values, scales = (x[0], x[1]) if is_pair else (x, None)
    _tensor_arg("x[0]" if is_pair else "x", values)
    if is_pair:
        _tensor_arg("x[1]", scales)
        if topk_weights is not None:
            topk_weights = topk_weights.detach()
    if topk_idx is None:
        v.fail("topk_idx", "required when no handle is given")
    _tensor_arg("topk_idx", topk_idx)
    if topk_weights is not None:
        _tensor_arg("topk_weights", topk_weights)
    v.check_num_experts(num_experts, buf.world_size)
    v.check_int("expert_alignment", expert_alignment, minimum=1)
    v.check_int("num_worst_tokens", num_worst_tokens, minimum=0)
    if not torch.compiler.is_compiling():  # eager: the Buffer call under autograd, no operator layer
        recv_x, recv_scales, recv_idx, recv_w, per_expert, handle = eager_ops.dispatch(
            buf, values, scales, topk_idx, topk_weights, num_experts, expert_alignment, num_worst_tokens)
        return ((recv_x, recv_scales) if is_pair else recv_x), recv_idx, recv_w, per_expert, handle
    (recv_x, recv_scales, recv_idx, recv_w, counts, in_rank, send_pos, count_matrix, recv_src_idx,
     node_counts) = _ops.dispatch(buf.buffer_id, values, scales, topk_idx, topk_weights, num_experts,
                                  expert_alignment, num_worst_tokens)
    if num_worst_tokens:
        per_expert = counts
    else:
        per_expert = counts.tolist()  # under torch.compile: unbacked ints (capture_scalar_outputs)
        for count in per_expert:
            torch._check(count >= 0)  # a size: lets the compiler size tensors by these counts
    node_counts = c.present(node_counts)
    handle = Handle(buffer_id=buf.buffer_id, num_experts=num_experts, num_tokens=values.shape[0],
                    hidden=values.shape[1], num_recv=recv_src_idx.shape[0], is_token_in_rank=in_rank,
                    send_pos=send_pos, count_matrix=count_matrix, recv_src_idx=recv_src_idx,
                    num_recv_tokens_per_expert=per_expert, node_count_matrix=node_counts,
                    per_expert_tensor=None if num_worst_tokens else counts)
    if node_counts is not None and not torch.compiler.is_compiling():
        handle.node_route = c.node_route_of(recv_src_idx)
    return ((recv_x, recv_scales) if is_pair else recv_x), recv_idx, c.present(recv_w), per_expert, handle


def _dispatch_setup(ctx, inputs, output):
    buffer_id, x, x_scales, _, topk_weights, num_experts, _, num_worst_tokens = inputs
    recv_idx = output[2]
    counts, in_rank, send_pos, count_matrix, recv_src_idx, node_counts = output[4:]
    ctx.buffer_id, ctx.num_experts, ctx.hidden = buffer_id, num_experts, x.shape[1]
    ctx.worst_case, ctx.x_dtype = num_worst_tokens > 0, x.dtype
    ctx.has_weights = topk_weights is not None
    # Save only the local-slot mask: recv_topk_idx may be a view of the CUDA backend's arena, and holding it
    # until backward would pin an arena block per layer.
    ctx.save_for_backward(in_rank, send_pos, count_matrix, recv_src_idx, counts, node_counts,
                          recv_idx >= 0 if ctx.has_weights else None)


def _dispatch_backward(ctx, grad_recv_x, _g_scales, _g_idx, grad_recv_weights, *_g_handle):
    in_rank, send_pos, count_matrix, recv_src_idx, counts, node_counts, local_slots = ctx.saved_tensors
    grad_recv_x, weights = eager_ops.dispatch_backward_inputs(
        grad_recv_x, grad_recv_weights, local_slots if ctx.has_weights else None, recv_src_idx.shape[0],
        ctx.hidden, ctx.x_dtype, in_rank.device)
    grad_x, grad_weights = _ops.combine(ctx.buffer_id, grad_recv_x, weights, in_rank, send_pos,
                                        count_matrix, recv_src_idx, counts, c.present(node_counts),
                                        ctx.num_experts, ctx.hidden, ctx.worst_case, False)
    return None, grad_x, None, None, grad_weights if ctx.has_weights else None, None, None, None


torch.library.register_autograd("deepcomm::dispatch", _dispatch_backward, setup_context=_dispatch_setup)


# ---- normal combine ----------------------------------------------------------------------------------------
def combine(buf, x, handle: Handle, topk_weights=None, use_fp8: bool = False):
    """Differentiable ``buf.combine``; returns ``(combined_x, combined_topk_weights)``. Gradients flow to
    ``x`` and ``topk_weights``. With ``use_fp8`` the forward rows travel as FP8 and the backward treats the cast
    as the identity (straight-through): the gradients are dispatched in ``x``'s dtype."""
    _check_handle(buf, handle)
    _tensor_arg("x", x)
    if topk_weights is not None:
        _tensor_arg("topk_weights", topk_weights)
    if not isinstance(use_fp8, bool):
        v.fail("use_fp8", f"expected a bool, got {type(use_fp8).__name__}")
    if not torch.compiler.is_compiling():
        return eager_ops.combine(buf, x, handle, topk_weights, use_fp8)
    combined_x, combined_w = _ops.combine(buf.buffer_id, x, topk_weights, *handle_args(handle), use_fp8)
    return combined_x, c.present(combined_w)


def _combine_setup(ctx, inputs, output):
    buffer_id, x, topk_weights, in_rank, send_pos, count_matrix, recv_src_idx, counts, node_counts = inputs[:9]
    ctx.buffer_id = buffer_id
    ctx.num_experts, ctx.hidden, ctx.worst_case = inputs[9:12]
    ctx.x_shape = (in_rank.shape[0], x.shape[1])
    ctx.x_dtype = x.dtype
    ctx.weights_k = None if topk_weights is None else topk_weights.shape[1]
    ctx.has_node_counts = node_counts is not None
    ctx.save_for_backward(in_rank, send_pos, count_matrix, recv_src_idx, counts, node_counts)


def _combine_backward(ctx, grad_combined_x, grad_combined_weights):
    in_rank, send_pos, count_matrix, recv_src_idx, counts, node_counts = ctx.saved_tensors
    grad_combined_x, weights = eager_ops.combine_backward_inputs(grad_combined_x, grad_combined_weights,
                                                                 ctx.x_shape, ctx.weights_k, ctx.x_dtype,
                                                                 in_rank.device)
    grad_x, _, grad_weights = _ops.cached_dispatch(ctx.buffer_id, grad_combined_x, None, weights,
                                                   in_rank, send_pos, count_matrix, recv_src_idx, counts,
                                                   node_counts if ctx.has_node_counts else None, ctx.num_experts,
                                                   ctx.hidden, ctx.worst_case)
    return ((None, grad_x, grad_weights if ctx.weights_k is not None else None) + (None,) * 10)


torch.library.register_autograd("deepcomm::combine", _combine_backward, setup_context=_combine_setup)


# ---- low-latency mode (no autograd) ------------------------------------------------------------------------
def low_latency_dispatch(buf, x, topk_idx, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                         use_fp8: bool = True, use_ue8m0: bool = False):
    """``buf.low_latency_dispatch`` without a hook (the receive half runs at once): ``(recv_x, recv_count,
    handle)``, static shapes. Not differentiable."""
    _tensor_arg("x", x)
    _tensor_arg("topk_idx", topk_idx)
    v.check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, minimum=1)
    v.check_num_experts(num_experts, buf.world_size)
    for name, flag in (("use_fp8", use_fp8), ("use_ue8m0", use_ue8m0)):
        if not isinstance(flag, bool):
            v.fail(name, f"expected a bool, got {type(flag).__name__}")
    if not torch.compiler.is_compiling():  # eager: the Buffer call itself (the receive half at once)
        recv_x, recv_count, handle, _ = buf.low_latency_dispatch(x.detach(), topk_idx,
                                                                 num_max_dispatch_tokens_per_rank, num_experts,
                                                                 use_fp8=use_fp8, use_ue8m0=use_ue8m0)
        return recv_x, recv_count, handle
    values, scales, recv_count, src_info, layout, recv_pos, slot = _ops.low_latency_dispatch(
        buf.buffer_id, x.detach(), topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, use_ue8m0)
    # the slot is the backend's choice at run time: a 0-d tensor inside a compiled graph, an int in eager
    handle = LowLatencyHandle(src_info=src_info, layout=layout, recv_pos=recv_pos, num_experts=num_experts,
                              num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank, hidden=x.shape[1],
                              buffer_id=buf.buffer_id, slot=slot if torch.compiler.is_compiling() else int(slot))
    return ((values, scales) if use_fp8 else values), recv_count, handle


def low_latency_combine(buf, x, topk_idx, topk_weights, handle: LowLatencyHandle, use_fp8: bool = False):
    """``buf.low_latency_combine`` without a hook: the combined bf16 ``[T, H]``. Not differentiable."""
    v.check_handle(handle, LowLatencyHandle, buf.buffer_id)
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        _tensor_arg(name, t)
    if not isinstance(use_fp8, bool):
        v.fail("use_fp8", f"expected a bool, got {type(use_fp8).__name__}")
    if not torch.compiler.is_compiling():
        return buf.low_latency_combine(x.detach(), topk_idx, topk_weights.detach(), handle, use_fp8=use_fp8)[0]
    slot = handle.slot if torch.is_tensor(handle.slot) else torch.tensor(handle.slot, dtype=torch.int32)
    return _ops.low_latency_combine(buf.buffer_id, x.detach(), topk_idx, topk_weights.detach(), handle.src_info,
                                    handle.layout, handle.recv_pos, slot, handle.num_experts,
                                    handle.num_max_dispatch_tokens_per_rank, handle.hidden, use_fp8)
