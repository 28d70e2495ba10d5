"""The differentiable normal-mode calls outside torch.compile: the Buffer's own calls under a torch.autograd.Function
(or, with nothing to differentiate, without one).

deepcomm.ops takes this path whenever it is not being traced. It computes what the operators of
deepcomm/custom_ops.py compute (their implementations are the same Buffer calls, and the backward of each is the
other call along the same handle, as in deepcomm/ops.py), without the operator layer: no dispatcher, no schema,
no handle taken apart into tensors and rebuilt, which costs tens of microseconds of host time per call. The handle
a dispatch returns is the Buffer's own and goes to backward as it is.
"""
from __future__ import annotations

from typing import Optional

import torch


def dispatch_backward_inputs(grad_recv_x, grad_recv_weights, local_slots, rows: int, hidden: int, dtype, device):
    """What a dispatch's backward combines: the gradient of recv_x (zeros when it has none) and, with weights
    (``local_slots`` given), their gradients masked to the slots that were local at the receiver (the only ones
    dispatch forwarded). Shared by this module and the operators' autograd (deepcomm/ops.py)."""
    if grad_recv_x is None:
        grad_recv_x = torch.zeros(rows, hidden, dtype=dtype, device=device)
    weights = None
    if local_slots is not None:
        if grad_recv_weights is None:
            grad_recv_weights = torch.zeros(local_slots.shape, dtype=torch.float32, device=device)
        weights = torch.where(local_slots, grad_recv_weights, 0.0)
    return grad_recv_x.contiguous(), weights


def combine_backward_inputs(grad_combined_x, grad_combined_weights, shape, weights_k: Optional[int], dtype,
                            device):
    """What a combine's backward dispatches along the handle: the gradient of the combined x (zeros when it has
    none, ``shape`` = (tokens, hidden)) and, with ``weights_k`` columns of weights, theirs (zeros when none)."""
    if grad_combined_x is None:
        grad_combined_x = torch.zeros(shape, dtype=dtype, device=device)
    weights = None
    if weights_k is not None:
        weights = (torch.zeros(shape[0], weights_k, dtype=torch.float32, device=device)
                   if grad_combined_weights is None else grad_combined_weights.contiguous())
    return grad_combined_x.contiguous(), weights


def _buffer_dispatch(buf, values, scales, topk_idx, topk_weights, num_experts: int, expert_alignment: int,
                     num_worst_tokens: int):
    """``buf.dispatch`` of ``values`` (with its ``scales``, an FP8 pair), its outputs as ``dispatch`` returns
    them."""
    recv_x, recv_idx, recv_w, per_expert, handle = buf.dispatch(
        values if scales is None else (values, scales), topk_idx=topk_idx, topk_weights=topk_weights,
        num_experts=num_experts, expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)
    recv_values, recv_scales = recv_x if scales is not None else (recv_x, None)
    return recv_values, recv_scales, recv_idx, recv_w, per_expert, handle


# The autograd functions below take as graph inputs only the tensors that can carry a gradient, and return as graph
# outputs only the ones that can: everything else goes in and out through one plain list (``call``). torch's
# autograd pays per argument and per output of an apply (wrapping, checks, the zeros it makes for unused
# gradients), which is host time on every training step.
class _Dispatch(torch.autograd.Function):
    """Forward: ``buf.dispatch``; backward: ``buf.combine`` of the gradients along the same handle (the weights'
    gradients masked to the slots that were local at the receiver, the only ones dispatch forwarded). ``call``:
    ``[buf, scales, topk_idx, num_experts, expert_alignment, num_worst_tokens]``, to which forward appends
    ``(recv_scales, recv_topk_idx, counts, handle)``, the outputs that are not the graph's."""

    @staticmethod
    def forward(ctx, call: list, values, topk_weights):
        buf, scales, topk_idx, num_experts, expert_alignment, num_worst_tokens = call
        recv_values, recv_scales, recv_idx, recv_w, per_expert, handle = _buffer_dispatch(
            buf, values, scales, topk_idx, topk_weights, num_experts, expert_alignment, num_worst_tokens)
        call.append((recv_scales, recv_idx, per_expert, handle))
        ctx.buf, ctx.handle, ctx.x_dtype = buf, handle, values.dtype
        # only the local-slot mask is kept: recv_topk_idx is a view of the CUDA backend's arena, and holding it
        # until backward would pin an arena block per layer
        ctx.local_slots = recv_idx >= 0 if topk_weights is not None else None
        if not values.requires_grad:  # an output without a path back to a graph input (its backward still runs)
            ctx.mark_non_differentiable(recv_values)
        return recv_values, recv_w

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_weights):
        handle = ctx.handle
        grad_recv_x, weights = dispatch_backward_inputs(grad_recv_x, grad_recv_weights, ctx.local_slots,
                                                        handle.num_recv, handle.hidden, ctx.x_dtype,
                                                        handle.recv_src_idx.device)
        grad_x, grad_weights = ctx.buf.combine(grad_recv_x, handle, topk_weights=weights)
        return None, grad_x, grad_weights


class _Combine(torch.autograd.Function):
    """Forward: ``buf.combine``; backward: a cached dispatch of the gradients along the same handle (every copy of
    a token receives the token's gradient). With ``use_fp8`` the backward treats the cast as the identity.
    ``call``: ``(buf, handle, use_fp8)``."""

    @staticmethod
    def forward(ctx, call: tuple, x, topk_weights):
        buf, handle, use_fp8 = call
        combined_x, combined_w = buf.combine(x, handle, topk_weights=topk_weights, use_fp8=use_fp8)
        ctx.buf, ctx.handle, ctx.x_dtype = buf, handle, x.dtype
        ctx.weights_k = None if topk_weights is None else topk_weights.shape[1]
        return combined_x, combined_w

    @staticmethod
    def backward(ctx, grad_combined_x, grad_combined_weights):
        handle = ctx.handle
        grad_combined_x, weights = combine_backward_inputs(grad_combined_x, grad_combined_weights,
                                                           (handle.num_tokens, handle.hidden), ctx.weights_k,
                                                           ctx.x_dtype, handle.recv_src_idx.device)
        grad_x, _, grad_weights, _, _ = ctx.buf.dispatch(grad_combined_x, topk_weights=weights, handle=handle)
        return None, grad_x, grad_weights if ctx.weights_k is not None else None


def _wants_grad(*tensors) -> bool:
    """Whether autograd would record a call on these inputs (grad mode on and one of them requiring a gradient):
    else the Buffer call is made without a torch.autograd.Function, whose bookkeeping and the dispatch's
    local-slot mask (a kernel launch) cost host time per call for nothing. The collective calls are the same
    either way, so ranks may differ here."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def dispatch(buf, values, scales, topk_idx, topk_weights, num_experts: int, expert_alignment: int,
             num_worst_tokens: int):
    """``(recv_values, recv_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert, handle)``."""
    if not _wants_grad(values, topk_weights):
        return _buffer_dispatch(buf, values, scales, topk_idx, topk_weights, num_experts, expert_alignment,
                                num_worst_tokens)
    call = [buf, scales, topk_idx, num_experts, expert_alignment, num_worst_tokens]
    recv_values, recv_w = _Dispatch.apply(call, values, topk_weights)
    recv_scales, recv_idx, per_expert, handle = call[-1]
    return recv_values, recv_scales, recv_idx, recv_w, per_expert, handle


def combine(buf, x, handle, topk_weights: Optional[torch.Tensor], use_fp8: bool):
    if not _wants_grad(x, topk_weights):
        return buf.combine(x, handle, topk_weights=topk_weights, use_fp8=use_fp8)
    return _Combine.apply((buf, handle, use_fp8), x, topk_weights)
