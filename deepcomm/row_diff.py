"""What rows of a received tensor that differ from the reference look like: for a GPU test or soak that fails, the
text says which source ranks the rows came from, whether they are still wrong once the device is synchronized
(wrong rows, or rows read before they landed), and what each wrong row holds instead (zeros, another row of this
call, or a row of an earlier call's output). ``received_rows`` is an oracle of the rows a rank must receive."""
from __future__ import annotations

import torch


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def differing_indices(got: torch.Tensor, want: torch.Tensor) -> list:
    """Indices of the rows of ``got`` that differ from ``want`` (the same shape and type) in any byte."""
    return (_rows(got) != _rows(want)).any(dim=1).nonzero()[:, 0].tolist()


def received_rows(sent, num_experts: int, rank: int) -> torch.Tensor:
    """The rows ``rank`` must receive from a normal-mode dispatch, given every rank's ``(rows, topk_idx)`` in rank
    order: each source's rows that name an expert of ``rank``, sources ascending, tokens ascending. An oracle of
    recv_x that needs no collective, where each rank can draw every rank's inputs again."""
    from . import layout
    world = len(sent)
    return torch.cat([rows[layout.token_in_rank(idx, num_experts, world)[:, rank]] for rows, idx in sent])


def differing_rows(got: torch.Tensor, want: torch.Tensor) -> str:
    """How many rows of ``got`` differ from ``want`` in any byte, as text ("a different shape" where they differ
    in shape or type)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"a different shape ({tuple(got.shape)} against {tuple(want.shape)})"
    return str(len(differing_indices(got, want))) if got.numel() else "0"


def _find(row: torch.Tensor, table: torch.Tensor) -> list:
    """Indices of ``table``'s rows equal to ``row`` (both uint8 rows of the same width)."""
    if table.shape[0] == 0 or table.shape[1] != row.shape[0]:
        return []
    return (table == row).all(dim=1).nonzero()[:, 0].tolist()


def explain_rows(got: torch.Tensor, want: torch.Tensor, recv_counts, earlier=(), shown: int = 4) -> str:
    """``got`` against ``want`` (the same shape, rows ordered by source rank as ``recv_counts`` gives them);
    ``earlier``: tensors of earlier calls whose rows a wrong row may repeat. An empty string where they are equal."""
    rows = differing_indices(got, want)
    if not rows:
        return ""
    bounds = torch.tensor(list(recv_counts)).cumsum(0).tolist()
    sources = sorted({next(s for s, b in enumerate(bounds) if r < b) for r in rows})
    if got.is_cuda:
        torch.cuda.synchronize(got.device)
    after = differing_indices(got, want)
    parts = [f"{len(rows)} of {got.shape[0]} rows differ (from source ranks {sources}; received per source "
             f"{list(recv_counts)}); after a device synchronize {len(after)} still differ"]
    g, w = _rows(got), _rows(want)
    zero = torch.zeros_like(g[0])
    for r in rows[:shown]:
        row = g[r]
        what = []
        if torch.equal(row, zero):
            what.append("zeros")
        same = [j for j in _find(row, w) if j != r]
        if same:
            what.append(f"reference row {same[0]} of this call")
        for i, t in enumerate(earlier):
            hit = _find(row, _rows(t))
            if hit:
                what.append(f"row {hit[0]} of earlier output {i}")
        bytes_off = (row != w[r]).nonzero()[:, 0]
        what.append(f"{bytes_off.numel()} bytes differ, from byte {bytes_off[0].item() if bytes_off.numel() else -1}")
        parts.append(f"row {r}: " + ", ".join(what))
    return "; ".join(parts)
