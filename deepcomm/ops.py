"""Differentiable dispatch and combine.

dispatch and combine are adjoint linear maps along one route, so each one's backward is the other:
- dispatch backward: combine the gradients of recv_x (and of recv_topk_weights, masked to the slots that
  were local at the receiver, the only ones dispatch forwarded) back to the source tokens.
- combine backward: re-dispatch the gradients along the cached handle; every copy of a token receives the
  token's gradient (topk_weights too: combine summed all of them).
FP8 pairs are not differentiable and go straight to the Buffer.
"""
from __future__ import annotations

from typing import Optional

import torch

from .handle import Handle


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, buf, topk_idx, num_experts, expert_alignment):
        recv_x, recv_topk_idx, recv_topk_weights, counts, handle = buf.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts,
            expert_alignment=expert_alignment)
        ctx.buf, ctx.handle = buf, handle
        ctx.x_dtype = x.dtype
        ctx.has_weights = topk_weights is not None
        # Save only the local-slot mask: recv_topk_idx may be a view of the CUDA backend's arena, and holding it
        # until backward would pin an arena block per layer.
        ctx.save_for_backward(recv_topk_idx >= 0 if ctx.has_weights else None)
        ctx.mark_non_differentiable(recv_topk_idx)
        return recv_x, recv_topk_idx, recv_topk_weights, counts, handle

    @staticmethod
    def backward(ctx, grad_recv_x, _grad_idx, grad_recv_weights, _grad_counts, _grad_handle):
        (local_slots,) = ctx.saved_tensors
        handle: Handle = ctx.handle
        if grad_recv_x is None:
            grad_recv_x = torch.zeros(handle.num_recv, handle.hidden, dtype=ctx.x_dtype, device=ctx.buf.device)
        weights = None
        if ctx.has_weights:
            if grad_recv_weights is None:
                grad_recv_weights = torch.zeros(local_slots.shape, dtype=torch.float32, device=ctx.buf.device)
            weights = torch.where(local_slots, grad_recv_weights, torch.zeros_like(grad_recv_weights))
        grad_x, grad_weights = ctx.buf.combine(grad_recv_x.contiguous(), handle, topk_weights=weights)
        return grad_x, grad_weights, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, buf, handle, use_fp8):
        combined_x, combined_weights = buf.combine(x, handle, topk_weights=topk_weights, use_fp8=use_fp8)
        ctx.buf, ctx.handle = buf, handle
        ctx.x_dtype = x.dtype
        ctx.weights_k = None if topk_weights is None else topk_weights.shape[1]
        return combined_x, combined_weights

    @staticmethod
    def backward(ctx, grad_combined_x, grad_combined_weights):
        handle: Handle = ctx.handle
        if grad_combined_x is None:
            grad_combined_x = torch.zeros(handle.num_tokens, handle.hidden, dtype=ctx.x_dtype,
                                          device=ctx.buf.device)
        weights = None
        if ctx.weights_k is not None:
            weights = (torch.zeros(handle.num_tokens, ctx.weights_k, dtype=torch.float32, device=ctx.buf.device)
                       if grad_combined_weights is None else grad_combined_weights.contiguous())
        grad_x, _, grad_weights, _, _ = ctx.buf.dispatch(grad_combined_x.contiguous(), topk_weights=weights,
                                                         handle=handle)
        return grad_x, grad_weights, None, None, None


def dispatch(buf, x, topk_idx, topk_weights=None, num_experts: Optional[int] = None, expert_alignment: int = 1):
    """Differentiable ``buf.dispatch``; returns ``(recv_x, recv_topk_idx, recv_topk_weights,
    num_recv_tokens_per_expert, handle)``. Gradients flow to ``x`` and ``topk_weights``."""
    if isinstance(x, (tuple, list)):
        return buf.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts,
                            expert_alignment=expert_alignment)
    return _Dispatch.apply(x, topk_weights, buf, topk_idx, num_experts, expert_alignment)


def combine(buf, x, handle: Handle, topk_weights=None, use_fp8: bool = False):
    """Differentiable ``buf.combine``; returns ``(combined_x, combined_topk_weights)``. Gradients flow to
    ``x`` and ``topk_weights``. With ``use_fp8`` the forward rows travel as FP8 and the backward treats the cast
    as the identity (straight-through): the gradients are dispatched in ``x``'s dtype."""
    return _Combine.apply(x, topk_weights, buf, handle, use_fp8)
