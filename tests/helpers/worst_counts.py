"""The per-expert counts of the ``num_worst_tokens`` dispatch form, eager and compiled, against the counts worked
out on the host from every rank's ``topk_idx``: one worker for the CPU (reference backend, gloo) and the GPU
(CUDA backend) tests of tests/api/test_compile*.py.

Each step of ``STEPS`` runs one worst-case dispatch + combine (forward, then backward unless the step says
otherwise) and records, for this rank: the counts right after the forward (synchronized and copied at once), the
same tensor again after the backward, the count matrix's column of this rank, and where the counts tensor lives
(inside the handle's workspace, inside the arena, or its own storage). The order of the steps tells a compiled
problem (only the compiled steps differ) from one of the second worst-case call (every step after the first).
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

# name, how it is called, whether a backward runs
STEPS = (("buffer eager", "buffer", False), ("ops eager", "ops", True), ("ops eager again", "ops", True),
         ("compiled aot_eager", "compiled", True), ("compiled aot_eager again", "compiled", True),
         ("compiled aot_eager, no grad", "compiled_nograd", False), ("ops eager after compiled", "ops", True))


def expected_counts(idx: torch.Tensor, rank: int, world: int, num_experts: int) -> torch.Tensor:
    """int32 [L]: tokens each local expert of ``rank`` receives (a token once per expert, however many of its
    slots name it), from every rank's ``topk_idx``."""
    gathered: List[torch.Tensor] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(gathered, idx.cpu())
    L = num_experts // world
    counts = torch.zeros(L, dtype=torch.int32)
    for t in gathered:
        for row in t.tolist():
            for e in set(row):
                if e >= 0 and e // L == rank:
                    counts[e - rank * L] += 1
    return counts


def _where(t: torch.Tensor, count_matrix: torch.Tensor, buf) -> str:
    """Which memory ``t`` (the counts) is in: the storage of the handle's count matrix (the CUDA backend's
    workspace), the arena, or its own."""
    ptr = t.data_ptr()
    work = count_matrix.untyped_storage()
    if work.data_ptr() <= ptr < work.data_ptr() + work.nbytes():
        return "handle workspace"
    arena = getattr(buf._backend, "arena", None)
    if arena is not None and arena.base_ptr <= ptr < arena.base_ptr + arena.nbytes:
        return "arena"
    return "own storage"


def run_steps(rank: int, world: int, buf, x, idx, w, num_experts: int, worst: int, phase: str = "") -> List[dict]:
    """Every step of STEPS on one Buffer, same inputs; a dict per step (see the module's docstring), its step
    name prefixed with ``phase``."""
    import deepcomm
    truth = expected_counts(idx, rank, world, num_experts)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)

    def step(x, idx, w):
        recv_x, _, recv_w, counts, handle = deepcomm.ops.dispatch(buf, x, idx, w, num_experts=num_experts,
                                                                  num_worst_tokens=worst)
        out, combined_w = deepcomm.ops.combine(buf, recv_x * 2.0, handle, topk_weights=recv_w)
        return out, combined_w, counts, handle.count_matrix

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    rows = []
    for name, how, backward in STEPS:
        xs, ws = x.clone().requires_grad_(backward), w.clone().requires_grad_(backward)
        if how == "buffer":
            recv_x, _, recv_w, counts, handle = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                             num_experts=num_experts, num_worst_tokens=worst)
            out, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
            matrix = handle.count_matrix
        elif how == "compiled_nograd":
            with torch.no_grad():
                out, _, counts, matrix = compiled(xs, idx, ws)
        else:
            fn = compiled if how == "compiled" else step
            out, combined_w, counts, matrix = fn(xs, idx, ws)
        sync()
        after_forward = counts.detach().cpu().clone()
        where = _where(counts, matrix, buf)
        column = int(matrix[:, rank].sum())
        if backward:
            (out.float().square().sum() + combined_w.sum()).backward()
            sync()
        rows.append(dict(step=phase + name, rank=rank, truth=truth.tolist(), after_forward=after_forward.tolist(),
                         after_backward=counts.detach().cpu().tolist(),
                         column=column, dtype=str(counts.dtype), device=str(counts.device), where=where))
    return rows


def normal_calls(buf, x, idx, w, num_experts: int) -> None:
    """Fresh (data-dependent) dispatch + combine, eager and compiled, forward and backward: what ran before the
    worst-case form in the test where its compiled counts were first seen to differ."""
    import deepcomm

    def step(x, idx, w):
        recv_x, _, recv_w, _, handle = deepcomm.ops.dispatch(buf, x, idx, w, num_experts=num_experts)
        return deepcomm.ops.combine(buf, recv_x * 2.0, handle, topk_weights=recv_w)

    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        out, combined_w = fn(x.clone().requires_grad_(), idx, w.clone().requires_grad_())
        (out.float().square().sum() + combined_w.sum()).backward()


def failures(rows: List[dict]) -> List[str]:
    """Lines naming every step whose counts are not the truth (after the forward or after the backward)."""
    bad = []
    for r in rows:
        for when in ("after_forward", "after_backward"):
            if r[when] != r["truth"]:
                bad.append(f"rank {r['rank']} {r['step']}: {when} {r[when]}, expected {r['truth']} "
                           f"(count matrix column {r['column']}, {r['dtype']} on {r['device']}, {r['where']})")
    return bad
