"""dispatch, combine and the low-latency calls as PyTorch operators (``torch.ops.deepcomm.*``), so that
torch.compile traces through them (docs/api.md, "torch.compile"). deepcomm.ops calls them (with autograd).

Each operator's real implementation is the Buffer call itself, every check included: what needs the data
(alignment of ``x``, the values of ``topk_idx``) is read there, on real tensors, and raises ValueError naming the
argument before any kernel runs. The fake implementation gives the output shapes from the input shapes, after the
checks that need no data (dtype, device, shape). A fresh dispatch's row count is an unbacked size; the
``num_worst_tokens`` form and the low-latency calls have static sizes.

An operator takes tensors and plain values, so:
- a Buffer is passed as its ``buffer_id`` (deepcomm/buffer_registry.py keeps the live ones);
- a Handle as its tensors (outputs of the dispatch operator, inputs of the others) and ints; the only part that is
  not a tensor, the internode kernels' forwarding record (``Handle.node_route``), is kept here by the identity of
  the handle's ``recv_src_idx``;
- an absent optional output (no weights, no FP8 scales, no node counts) is an empty 1-D tensor (present ones
  are 2-D or more).

The operators are defined with ``torch.library.define`` / ``impl`` rather than ``torch.library.custom_op``: the
CUDA backend returns disjoint views of one block (``recv_x``, ``recv_topk_idx``, ... of its arena; the
low-latency outputs of its receive area), which custom_op's no-aliasing check refuses. The views never overlap, so
writing into one output cannot change another.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import validation as v
from .buffer_registry import lookup
from .fp8 import BLOCK
from .cuda.owned_views import int32_host, workspace_outputs
from .handle import Handle, LowLatencyHandle, WorkspaceViews

_lib = torch.library.Library("deepcomm", "FRAGMENT")

# A normal-mode Handle as operator arguments (deepcomm.ops.handle_args makes them from a Handle).
HANDLE_SCHEMA = ("Tensor is_token_in_rank, Tensor send_pos, Tensor count_matrix, Tensor recv_src_idx, "
                 "Tensor num_recv_tokens_per_expert, Tensor? node_count_matrix, int num_experts, int hidden, "
                 "bool worst_case")
# recv_src_idx -> Handle.node_route (internode kernels only); weak: gone with the handle's tensor
_node_routes = WeakIdKeyDictionary()


def _define(name: str, schema: str, impl, fake) -> None:
    _lib.define(f"{name}{schema}")
    # The real implementation runs Python that torch.compile must not trace (it reads data, it talks to peers). It
    # never is: dynamo puts the operator in its graph as it is, and runs the compiled graph with itself disabled,
    # so the implementation's frames never reach it (tests/api/test_compile.py counts the frames). Wrapping it in
    # torch.compiler.disable would import torch._dynamo with deepcomm, seconds of every process's start-up.
    _lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"deepcomm::{name}", fake, lib=_lib)


def _absent(device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=device)


def present(t: torch.Tensor) -> Optional[torch.Tensor]:
    """An optional output back as a tensor or None (absent ones are 1-D: see the module's docstring)."""
    return None if t.dim() == 1 else t


def _has_node_counts(buf) -> bool:
    """Whether a dispatch of ``buf`` makes a Handle with ``node_count_matrix`` (the internode CUDA backend)."""
    return buf.backend_name == "cuda" and buf.topology.is_internode


def make_handle(buffer_id: int, is_token_in_rank, send_pos, count_matrix, recv_src_idx, num_recv_tokens_per_expert,
                node_count_matrix, num_experts: int, hidden: int, worst_case: bool) -> Handle:
    """The Handle of the operator arguments ``HANDLE_SCHEMA``: counts stay a tensor in the worst-case form (that is
    how backends tell it), a list otherwise."""
    counts = num_recv_tokens_per_expert if worst_case else num_recv_tokens_per_expert.tolist()
    return Handle(buffer_id=buffer_id, num_experts=num_experts, num_tokens=is_token_in_rank.shape[0], hidden=hidden,
                  num_recv=recv_src_idx.shape[0], is_token_in_rank=is_token_in_rank, send_pos=send_pos,
                  count_matrix=count_matrix, recv_src_idx=recv_src_idx, num_recv_tokens_per_expert=counts,
                  node_count_matrix=node_count_matrix, node_route=_node_route(recv_src_idx, node_count_matrix))


def _node_route(recv_src_idx, node_count_matrix):
    if node_count_matrix is None:
        return None
    if recv_src_idx not in _node_routes:
        raise RuntimeError("deepcomm: this internode handle's forwarding record is unknown here: pass the "
                           "recv_src_idx tensor its dispatch returned (not a copy)")
    return _node_routes[recv_src_idx]


def node_route_of(recv_src_idx):
    return _node_routes.get(recv_src_idx)


def remember_route(handle: Handle) -> None:
    """Keep an internode handle's forwarding record (None with the NVSHMEM transport) for the operators."""
    if handle.node_count_matrix is not None:
        _node_routes[handle.recv_src_idx] = handle.node_route


def _payload(x, x_scales):
    return x if x_scales is None else (x, x_scales)


def _check_x_shapes(buf, x, x_scales) -> Tuple[int, int]:
    """The checks of a normal-mode ``x`` that need no data; ``(T, H)``."""
    if x_scales is None:
        v.check_tensor("x", x, buf._x_dtypes, buf.device, 2)
    else:
        v.check_tensor("x[0]", x, (v.FP8_DTYPE,), buf.device, 2)
        v.check_fp8_scales("x[1]", x_scales, x.shape[0], x.shape[1], buf.device)
    return x.shape[0], x.shape[1]


# ---- normal dispatch ---------------------------------------------------------------------------------------
# the Handle's routing tensors, in the order of the dispatch operator's outputs
ROUTING = ("is_token_in_rank", "send_pos", "count_matrix", "recv_src_idx")
DISPATCH_OUTPUTS = ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert",
                    "is_token_in_rank", "send_pos", "count_matrix", "recv_src_idx", "node_count_matrix")


def _dispatch(buffer_id, x, x_scales, topk_idx, topk_weights, num_experts, expert_alignment, num_worst_tokens):
    buf = lookup(buffer_id)
    recv_x, recv_idx, recv_w, per_expert, handle = buf.dispatch(
        _payload(x, x_scales), topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts,
        expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)
    remember_route(handle)
    values, scales = recv_x if x_scales is not None else (recv_x, None)
    dev = buf.device
    # a fresh dispatch's counts are host ints (read back already): a CPU tensor; the worst-case form's stay where
    # they are (no host sync)
    counts = per_expert if torch.is_tensor(per_expert) else _host_counts(per_expert)
    node_counts = handle.node_count_matrix if _has_node_counts(buf) else None
    routing, empties = _routing_outputs(handle, (scales is None) + (recv_w is None) + (node_counts is None), dev)
    if handle.node_count_matrix is not None and routing[3] is not handle.recv_src_idx:
        _node_routes[routing[3]] = handle.node_route  # the internode forwarding record, under the new tensor too
    return (values, empties.pop() if scales is None else scales, recv_idx,
            empties.pop() if recv_w is None else recv_w, counts, *routing,
            empties.pop() if node_counts is None else node_counts)


def _host_counts(per_expert) -> torch.Tensor:
    made = int32_host(per_expert)
    return made if made is not None else torch.tensor(per_expert, dtype=torch.int32)


def _routing_outputs(handle: Handle, num_absent: int, device) -> Tuple[list, list]:
    """The handle's routing tensors as operator outputs, which must not share a storage (traced code may assume
    they do not), and ``num_absent`` empty tensors. The CUDA backend's are parts of one workspace, not made yet
    (deepcomm/handle.py WorkspaceViews): they become views with storages of their own over it, in one crossing
    (deepcomm/cuda/owned_views.py); other backends' (or without that crossing) are copied where they share one.
    Only traced code pays for this: eager deepcomm.ops calls the Buffer directly (deepcomm/eager_ops.py)."""
    work = handle.__dict__.get("_" + ROUTING[0])
    if type(work) is WorkspaceViews and all(handle.__dict__.get("_" + name) is work for name in ROUTING):
        made = workspace_outputs(work, ROUTING, num_absent)
        if made is not None:
            return list(made[:len(ROUTING)]), list(made[len(ROUTING):])
    routing = [getattr(handle, name) for name in ROUTING]
    seen = set()
    for i, t in enumerate(routing):
        key = t.untyped_storage().data_ptr()
        if key in seen or t._base is not None:
            routing[i] = t.clone()
        seen.add(key)
    return routing, [_absent(device) for _ in range(num_absent)]


def _dispatch_fake(buffer_id, x, x_scales, topk_idx, topk_weights, num_experts, expert_alignment,
                   num_worst_tokens):
    buf = lookup(buffer_id)
    T, H = _check_x_shapes(buf, x, x_scales)
    R = buf.world_size
    v.check_num_experts(num_experts, R)
    v.check_topk_idx(topk_idx, T, num_experts, buf.device, check_values=False)
    if topk_weights is not None:
        v.check_topk_weights(topk_weights, tuple(topk_idx.shape), buf.device)
    v.check_int("num_worst_tokens", num_worst_tokens, minimum=0)
    L, K, dev = num_experts // R, topk_idx.shape[1], buf.device
    # rows received: known only after the count exchange, at most every rank's maximum
    n = num_worst_tokens or torch.library.get_ctx().new_dynamic_size(max=R * buf.config.max_tokens_per_rank)
    int32 = dict(dtype=torch.int32, device=dev)
    return (x.new_empty(n, H), _absent(dev) if x_scales is None else x_scales.new_empty(n, x_scales.shape[1]),
            topk_idx.new_empty(n, K), _absent(dev) if topk_weights is None else topk_weights.new_empty(n, K),
            torch.empty(L, dtype=torch.int32, device=dev if num_worst_tokens else "cpu"),
            torch.empty(T, R, dtype=torch.bool, device=dev), torch.empty(T, R, **int32), torch.empty(R, R, **int32),
            torch.empty(n, **int32),
            torch.empty(R, buf.topology.num_nodes, **int32) if _has_node_counts(buf) else _absent(dev))


_define("dispatch", "(int buffer_id, Tensor x, Tensor? x_scales, Tensor topk_idx, Tensor? topk_weights, "
        "int num_experts, int expert_alignment, int num_worst_tokens) -> "
        f"({', '.join('Tensor ' + name for name in DISPATCH_OUTPUTS)})", _dispatch, _dispatch_fake)


# ---- cached dispatch (along a handle) ----------------------------------------------------------------------
def _cached_dispatch(buffer_id, x, x_scales, topk_weights, *handle_args):
    buf = lookup(buffer_id)
    handle = make_handle(buffer_id, *handle_args)
    recv_x, _, recv_w, _, _ = buf.dispatch(_payload(x, x_scales), topk_weights=topk_weights, handle=handle)
    values, scales = recv_x if x_scales is not None else (recv_x, None)
    dev = buf.device
    return values, _absent(dev) if scales is None else scales, _absent(dev) if recv_w is None else recv_w


def _cached_dispatch_fake(buffer_id, x, x_scales, topk_weights, is_token_in_rank, send_pos, count_matrix,
                          recv_src_idx, *_):
    buf = lookup(buffer_id)
    T, H = _check_x_shapes(buf, x, x_scales)
    if T != is_token_in_rank.shape[0]:
        v.fail("x", f"expected {is_token_in_rank.shape[0]} rows (handle.num_tokens), got {T}")
    if topk_weights is not None:
        v.check_topk_weights(topk_weights, (T, None), buf.device)
    n, dev = recv_src_idx.shape[0], buf.device
    return (x.new_empty(n, H), _absent(dev) if x_scales is None else x_scales.new_empty(n, x_scales.shape[1]),
            _absent(dev) if topk_weights is None else topk_weights.new_empty(n, topk_weights.shape[1]))


_define("cached_dispatch", f"(int buffer_id, Tensor x, Tensor? x_scales, Tensor? topk_weights, {HANDLE_SCHEMA}) "
        "-> (Tensor recv_x, Tensor recv_x_scales, Tensor recv_topk_weights)", _cached_dispatch,
        _cached_dispatch_fake)


# ---- normal combine ----------------------------------------------------------------------------------------
def _combine(buffer_id, x, topk_weights, *args):
    *handle_args, use_fp8 = args
    buf = lookup(buffer_id)
    combined_x, combined_w = buf.combine(x, make_handle(buffer_id, *handle_args), topk_weights=topk_weights,
                                         use_fp8=use_fp8)
    return combined_x, _absent(buf.device) if combined_w is None else combined_w


def _combine_fake(buffer_id, x, topk_weights, is_token_in_rank, send_pos, count_matrix, recv_src_idx, *_):
    buf = lookup(buffer_id)
    v.check_tensor("x", x, buf._x_dtypes, buf.device, 2, (recv_src_idx.shape[0], None))
    if topk_weights is not None:
        v.check_topk_weights(topk_weights, (recv_src_idx.shape[0], None), buf.device)
    T = is_token_in_rank.shape[0]
    return (x.new_empty(T, x.shape[1]),
            _absent(buf.device) if topk_weights is None else topk_weights.new_empty(T, topk_weights.shape[1]))


_define("combine", f"(int buffer_id, Tensor x, Tensor? topk_weights, {HANDLE_SCHEMA}, bool use_fp8) "
        "-> (Tensor combined_x, Tensor combined_topk_weights)", _combine, _combine_fake)


# ---- low-latency mode --------------------------------------------------------------------------------------
def _ll_dispatch(buffer_id, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, use_ue8m0):
    buf = lookup(buffer_id)
    recv_x, recv_count, handle, _ = buf.low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank,
                                                             num_experts, use_fp8=use_fp8, use_ue8m0=use_ue8m0)
    values, scales = recv_x if use_fp8 else (recv_x, None)
    return (values, _absent(buf.device) if scales is None else scales, recv_count, handle.src_info, handle.layout,
            handle.recv_pos, torch.tensor(handle.slot, dtype=torch.int32))


def _ll_dispatch_fake(buffer_id, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, use_ue8m0):
    buf = lookup(buffer_id)
    v.check_tensor("x", x, (torch.bfloat16,), buf.device, 2)
    v.check_num_experts(num_experts, buf.world_size)
    v.check_topk_idx(topk_idx, x.shape[0], num_experts, buf.device, check_values=False)
    R, M, H, dev = buf.world_size, num_max_dispatch_tokens_per_rank, x.shape[1], buf.device
    L, rows = num_experts // R, R * num_max_dispatch_tokens_per_rank
    int32 = dict(dtype=torch.int32, device=dev)
    values = torch.empty(L, rows, H, dtype=v.FP8_DTYPE if use_fp8 else torch.bfloat16, device=dev)
    scales = torch.empty(L, rows, H // BLOCK, dtype=torch.float32, device=dev) if use_fp8 else _absent(dev)
    return (values, scales, torch.empty(L, **int32), torch.empty(L, rows, **int32), torch.empty(L, R, 2, **int32),
            torch.empty(topk_idx.shape, **int32), torch.empty((), dtype=torch.int32))


_define("low_latency_dispatch", "(int buffer_id, Tensor x, Tensor topk_idx, int num_max_dispatch_tokens_per_rank, "
        "int num_experts, bool use_fp8, bool use_ue8m0) -> (Tensor recv_x, Tensor recv_x_scales, Tensor recv_count, "
        "Tensor src_info, Tensor layout, Tensor recv_pos, Tensor slot)", _ll_dispatch, _ll_dispatch_fake)


def make_low_latency_handle(buffer_id: int, src_info, layout, recv_pos, slot, num_experts: int,
                            num_max_dispatch_tokens_per_rank: int, hidden: int) -> LowLatencyHandle:
    return LowLatencyHandle(src_info=src_info, layout=layout, recv_pos=recv_pos, num_experts=num_experts,
                            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank, hidden=hidden,
                            buffer_id=buffer_id, slot=int(slot))


def _ll_combine(buffer_id, x, topk_idx, topk_weights, src_info, layout, recv_pos, slot, num_experts,
                num_max_dispatch_tokens_per_rank, hidden, use_fp8):
    buf = lookup(buffer_id)
    handle = make_low_latency_handle(buffer_id, src_info, layout, recv_pos, slot, num_experts,
                                     num_max_dispatch_tokens_per_rank, hidden)
    return buf.low_latency_combine(x, topk_idx, topk_weights, handle, use_fp8=use_fp8)[0]


def _ll_combine_fake(buffer_id, x, topk_idx, topk_weights, src_info, layout, recv_pos, slot, num_experts,
                     num_max_dispatch_tokens_per_rank, hidden, use_fp8):
    buf = lookup(buffer_id)
    v.check_tensor("x", x, (torch.bfloat16,), buf.device, 3, (src_info.shape[0], src_info.shape[1], None))
    v.check_tensor("topk_idx", topk_idx, (torch.int64,), buf.device, 2, tuple(recv_pos.shape))
    v.check_topk_weights(topk_weights, tuple(recv_pos.shape), buf.device)
    return x.new_empty(topk_idx.shape[0], x.shape[2])


_define("low_latency_combine", "(int buffer_id, Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor src_info, "
        "Tensor layout, Tensor recv_pos, Tensor slot, int num_experts, int num_max_dispatch_tokens_per_rank, "
        "int hidden, bool use_fp8) -> Tensor", _ll_combine, _ll_combine_fake)
