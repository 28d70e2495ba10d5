"""How large a CUDA backend's dispatch output arena is: room for a number of worst-case dispatch outputs, plus one
bounce area for a dispatch that finds the arena full (deepcomm/nvlink/backend.py)."""
from __future__ import annotations

from typing import Tuple

from ..config import env_positive_int

ARENA_OUTPUTS = 4         # worst-case dispatch outputs the arena holds at once (plus one bounce area) by default
ARENA_OUTPUTS_ENV = "DEEPCOMM_ARENA_OUTPUTS"


def worst_output_bytes(C, rows: int, hidden: int) -> int:
    bf16 = C.dispatch_out_layout(rows, hidden * 2, 0, C.TOPK_MAX)["total"]
    fp8 = C.dispatch_out_layout(rows, hidden, hidden // 128 * 4, C.TOPK_MAX)["total"]
    return max(bf16, fp8)


def arena_outputs() -> int:
    """Worst-case dispatch outputs the arena holds: ``$DEEPCOMM_ARENA_OUTPUTS`` where set (a positive int; more
    keeps more outputs alive on the zero-copy path, e.g. every layer's recv_x kept for backward), else
    ARENA_OUTPUTS. ``ValueError`` names the variable."""
    n = env_positive_int(ARENA_OUTPUTS_ENV)
    return ARENA_OUTPUTS if n is None else n


def arena_sizes(C, world_size: int, max_tokens: int, hidden: int) -> Tuple[int, int]:
    """``(arena, bounce)`` bytes: room for ``arena_outputs()`` worst-case dispatch outputs, and one more for the
    bounce area used when the arena is full. The NVLink buffer's arena region holds both."""
    worst = worst_output_bytes(C, world_size * max_tokens, hidden)
    return arena_outputs() * worst, worst
