"""How many bytes a Buffer's CUDA backend holds on each GPU, from the same layout code the kernels use.

``nvl_buffer_bytes(num_ranks, max_tokens_per_rank, hidden)`` asks the extension's ``NvlLayout`` (the one description
of the per-rank NVLink buffer, csrc/runtime/nvl_layout.hpp) and the CUDA backend's arena size; nothing here
re-derives offsets. Returns ``None`` when the extension is not built (then no NVLink buffer can exist anyway).

    python -m deepcomm.sizing --ranks 8 --tokens 4096 --hidden 7168
"""
from __future__ import annotations

import argparse
from typing import Dict, Optional

from ._ext import load_extension


def nvl_buffer_bytes(num_ranks: int, max_tokens_per_rank: int, hidden: int) -> Optional[Dict[str, int]]:
    """``{"signals", "combine_stage", "arena", "total"}`` bytes of one rank's NVLink buffer (``None`` without the
    extension). ``signals``: flags, counts and mailboxes; ``combine_stage``: rows coming back to this rank's
    tokens; ``arena``: room for the dispatch outputs (recv_x and friends) that peers write into directly."""
    C = load_extension()
    if C is None:
        return None
    from .cuda.backend import LOCAL_EXPERTS_CAP, TOPK_MAX, arena_sizes
    arena, bounce = arena_sizes(C, num_ranks, max_tokens_per_rank, hidden)
    lay = C.nvl_layout(num_ranks, LOCAL_EXPERTS_CAP, max_tokens_per_rank, hidden, TOPK_MAX, arena + bounce)
    return {"signals": lay["signal_bytes"], "combine_stage": lay["arena"] - lay["combine_stage"],
            "arena": lay["total"] - lay["arena"], "total": lay["total"]}


def _fmt(n: int) -> str:
    return f"{n / 2**20:10.1f} MiB" if n >= 2**20 else f"{n / 2**10:10.1f} KiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Bytes of deepcomm's per-GPU NVLink buffer for a Buffer's settings")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096, help="max_tokens_per_rank")
    p.add_argument("--hidden", type=int, default=7168)
    a = p.parse_args(argv)
    got = nvl_buffer_bytes(a.ranks, a.tokens, a.hidden)
    if got is None:
        print("deepcomm._C is not built: the CUDA backend (and its NVLink buffer) is unavailable")
        return 1
    print(f"ranks={a.ranks} max_tokens_per_rank={a.tokens} hidden={a.hidden}")
    for k in ("signals", "combine_stage", "arena", "total"):
        print(f"  {k:14s}{_fmt(got[k])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
