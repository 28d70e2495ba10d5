"""How many bytes a Buffer's CUDA backend holds on each GPU, from the same layout code the kernels use.

``nvl_buffer_bytes(num_ranks, max_tokens_per_rank, hidden)`` asks the extension's ``NvlLayout`` (the one description
of the per-rank NVLink buffer, csrc/runtime/nvl_layout.hpp) and the CUDA backend's arena size; nothing here
re-derives offsets. Returns ``None`` when the extension is not built (then no NVLink buffer can exist anyway).

``ll_buffer_bytes`` does the same for the low-latency buffer (csrc/runtime/ll_layout.hpp).

    python -m deepcomm.sizing --ranks 8 --tokens 4096 --hidden 7168 [--experts 256 --ll-tokens 128]
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
    from .nvlink.arena_sizing import arena_sizes
    arena, bounce = arena_sizes(C, num_ranks, max_tokens_per_rank, hidden)
    lay = C.nvl_layout(num_ranks, C.COUNTS_MAX_EXPERTS, max_tokens_per_rank, hidden, C.TOPK_MAX, arena + bounce)
    return {"signals": lay["signal_bytes"], "combine_stage": lay["arena"] - lay["combine_stage"],
            "arena": lay["total"] - lay["arena"], "total": lay["total"]}


def ll_buffer_bytes(num_ranks: int, num_experts: int, max_tokens: int, hidden: int,
                    outbox: bool = False) -> Optional[int]:
    """Bytes of one rank's low-latency buffer, made at the first low-latency call of this (experts, tokens, hidden)
    shape (``None`` without the extension). ``Buffer.size_bytes()`` counts it once it exists. ``outbox``: with the
    outbox of a buffer that reaches some peers by NVSHMEM puts (deepcomm/cuda/ll_buffer.py), as NVSHMEM's heap
    must then hold."""
    C = load_extension()
    if C is None:
        return None
    return C.LlContext(0, num_ranks, num_experts, max_tokens, hidden, C.TOPK_MAX, outbox).layout()["total"]


def _fmt(n: int) -> str:
    return f"{n / 2**20:10.1f} MiB" if n >= 2**20 else f"{n / 2**10:10.1f} KiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Bytes of deepcomm's per-GPU NVLink buffer for a Buffer's settings")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096, help="max_tokens_per_rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=0, help="also the low-latency buffer for this many experts")
    p.add_argument("--ll-tokens", type=int, default=128, help="num_max_dispatch_tokens_per_rank (low-latency)")
    a = p.parse_args(argv)
    got = nvl_buffer_bytes(a.ranks, a.tokens, a.hidden)
    if got is None:
        print("deepcomm._C is not built: the CUDA backend (and its NVLink buffer) is unavailable")
        return 1
    print(f"ranks={a.ranks} max_tokens_per_rank={a.tokens} hidden={a.hidden}")
    for k in ("signals", "combine_stage", "arena", "total"):
        print(f"  {k:14s}{_fmt(got[k])}")
    if a.experts:
        ll = ll_buffer_bytes(a.ranks, a.experts, a.ll_tokens, a.hidden)
        print(f"low-latency buffer (experts={a.experts}, tokens={a.ll_tokens}): {_fmt(ll).strip()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
