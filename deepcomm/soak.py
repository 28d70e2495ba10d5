"""`python -m deepcomm.soak`: randomized dispatch/combine on the chosen backend against the reference, bit for bit.

Every iteration draws a new shape (tokens per rank 0..max, hidden, top-k, experts, -1 masks, FP8/UE8M0/BF16,
normal or low-latency mode; the normal combine also with use_fp8 where H % 128 == 0; low-latency calls with or
without the receive hook, and the low-latency combine with or without FP8 on the wire; a low-latency (experts,
hidden) pair is kept for ``--ll-shape-every`` low-latency
iterations, since each new pair re-makes the low-latency buffer), runs it on ``--backend`` and on the reference
backend in the same process group, and compares every output byte. Inputs are drawn on the device. Runs ``--iterations`` or until ``--seconds`` pass, whichever comes first, then prints
the counts per mode/dtype on rank 0 and exits non-zero on any mismatch. ``--self-check`` flips one output byte in
one iteration to show the comparison catches it (the run must then fail). ``--keep N`` keeps the last N normal-mode
dispatch outputs alive, as training keeps every layer's ``recv_x`` for the backward pass: the Buffer's output space
fills, later dispatches take the exact-size and bounce placements (the summary counts each kind), and each kept
output is compared with its reference again when it is let go (a later call that wrote into it shows there).

    python -m deepcomm.soak --backend cuda --iterations 10000      # GPUs: one process per GPU
    python -m deepcomm.soak --world-size 4 --iterations 2000        # 4 ranks sharing the GPUs (MPS; docs/testing.md)
    python -m deepcomm.soak --device cpu --iterations 50           # reference against itself on CPU processes

``--progress`` prints each iteration's case on rank 0 before it runs (where a run stalls, its last line names the
case); ``--timeout-s`` sets the tested Buffer's timeout (a stalled wait then raises naming its stage); `bash
dev/device_matrix.sh soak` runs it bounded, with Python's tracebacks dumped if it does not end.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter, deque

from deepcomm.local_launch import device_type, init_rank, launch


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepcomm-soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="auto", choices=["auto", "cuda", "reference"])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--world-size", type=int, default=0)
    p.add_argument("--iterations", type=int, default=10000)
    p.add_argument("--seconds", type=float, default=0.0, help="stop after this long (0: no limit)")
    p.add_argument("--max-tokens", type=int, default=2048,
                   help="normal-mode tokens per rank drawn up to this (past 512: a fresh dispatch's notify spans "
                        "several blocks)")
    p.add_argument("--max-hidden", type=int, default=4096)
    p.add_argument("--max-ll-tokens", type=int, default=128)
    p.add_argument("--modes", default="normal,low_latency")
    p.add_argument("--ll-shape-every", type=int, default=50,
                   help="low-latency iterations per (experts, hidden) shape; a new shape re-makes the low-latency "
                        "buffer (a collective IPC allocation), so drawing one per iteration would dominate the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--self-check", action="store_true")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="the tested Buffer's timeout: a stalled wait raises CommTimeoutError naming its stage")
    p.add_argument("--keep", type=int, default=0,
                   help="keep the last N normal-mode dispatch outputs alive, each checked again when let go")
    p.add_argument("--progress", action="store_true",
                   help="rank 0 prints each iteration's case before it runs, so a run that stalls shows where")
    return p


def _same(a, b) -> bool:
    import torch
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if not torch.is_tensor(a):
        return a == b
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _flip_one_byte(t) -> bool:
    """Corrupt ``t``'s first byte (``--self-check``); False when there is nothing to corrupt."""
    import torch
    if t.numel() == 0:
        return False
    t.reshape(-1).view(torch.uint8)[:1].bitwise_xor_(1)
    return True


class Case:
    """The shape of one iteration; drawn from a generator that every rank seeds the same way. A low-latency case
    takes its (experts, hidden) from ``ll_shape`` (see ``draw_ll_shape``) and draws the rest."""

    def __init__(self, rng: random.Random, world: int, args, ll_shape=None):
        self.mode = rng.choice(args.modes.split(","))
        self.dtype = rng.choice(["bf16", "fp8", "ue8m0"])
        low_latency = self.mode == "low_latency"
        if low_latency and ll_shape is not None:
            self.experts, self.hidden = ll_shape
        else:
            self.experts = world * rng.choice([1, 2, 4, 8, 32])
            step = 128 if (low_latency or self.dtype != "bf16") else 8
            if self.dtype == "ue8m0" and not low_latency:
                step = 512  # packed UE8M0 scales need H % 512 == 0
            self.hidden = step * rng.randint(1, args.max_hidden // step)
        self.topk = rng.randint(1, min(8, self.experts))
        self.mask = rng.choice([0.0, 0.0, 0.2, 0.6])
        self.hook = rng.random() < 0.3          # low-latency: send, then the receive half from the hook
        self.combine_fp8 = rng.random() < 0.3   # low-latency combine: partials cross as e4m3 + scales
        self.max_tokens = args.max_ll_tokens if low_latency else args.max_tokens

    def label(self) -> str:
        return f"{self.mode}-{self.dtype}"


def draw_ll_shape(rng: random.Random, world: int, args):
    """``(experts, hidden)`` of the next run of low-latency cases."""
    return world * rng.choice([1, 2, 4, 8, 32]), 128 * rng.randint(1, args.max_hidden // 128)


def _inputs(case: Case, rng: random.Random, gen, device):
    """Random tensors drawn on ``device`` by ``gen`` (drawing the larger ones on the CPU and copying them cost most
    of an iteration); the token count comes from this rank's ``rng``, so no device value is read back for it."""
    import torch
    T = rng.randint(0, case.max_tokens)
    scores = torch.rand(T, case.experts, generator=gen, device=device)
    idx = scores.topk(case.topk, dim=1).indices if T else torch.zeros(0, case.topk, dtype=torch.int64, device=device)
    drop = torch.rand(T, case.topk, generator=gen, device=device) < case.mask
    idx = torch.where(drop, torch.full_like(idx, -1), idx)
    x = (torch.randn(T, case.hidden, generator=gen, device=device) * 4).to(torch.bfloat16)
    w = torch.rand(T, case.topk, generator=gen, device=device)
    return x, idx, w


def _seed(args, it: int, rank: int) -> int:
    """The seed of ``rank``'s inputs at iteration ``it``: inputs differ by rank and iteration, and any rank can draw
    any rank's again (``_expected_recv``)."""
    return args.seed * 1_000_003 + it * 131 + rank


def _payload(case, x):
    """What a normal-mode dispatch of this case sends: ``x``, or its FP8 pair (UE8M0 scales packed)."""
    if case.dtype == "bf16":
        return x
    from deepcomm.fp8 import pack_ue8m0, per_token_cast_to_fp8
    vals, scales = per_token_cast_to_fp8(x, use_ue8m0=case.dtype == "ue8m0")
    return vals, pack_ue8m0(scales) if case.dtype == "ue8m0" else scales


def _expected_recv(case, args, it: int, world: int, rank: int, device):
    """The rows of recv_x this rank must receive, from every rank's inputs drawn again here: an oracle without any
    collective (the reference backend's all-to-all included), to tell which side of a mismatch is wrong."""
    import torch
    from deepcomm.row_diff import received_rows
    gen = torch.Generator(device=device)
    sent = []
    for s in range(world):
        gen.manual_seed(_seed(args, it, s))
        x, idx, _ = _inputs(case, random.Random(_seed(args, it, s)), gen, device)
        sent.append((_values(_payload(case, x)), idx))
    return received_rows(sent, case.experts, rank)


def _values(recv):
    """The rows of a received ``recv_x``: the tensor, or the values of an FP8 pair."""
    return recv[0] if isinstance(recv, tuple) else recv


def _normal(buf, ref, case, x, idx, w, gen, device, corrupt, rank, earlier=(), expected=None):
    """``(names of the outputs that differ, a byte was corrupted, (received, reference) rows of the dispatch)``;
    a differing ``recv_x`` is described by deepcomm.row_diff (``earlier``: kept outputs' rows it may repeat), and
    (``expected``: a callable giving the rows this rank must receive) says how many rows of each side differ from
    them."""
    import torch
    payload = _payload(case, x)
    got = buf.dispatch(payload, topk_idx=idx, topk_weights=w, num_experts=case.experts, expert_alignment=4)
    want = ref.dispatch(payload, topk_idx=idx, topk_weights=w, num_experts=case.experts, expert_alignment=4)
    flipped = corrupt and _flip_one_byte(_values(got[0]))
    differ = [name for name, a, b in zip(("recv_x", "recv_topk_idx", "recv_topk_weights", "per_expert"),
                                         got[:4], want[:4]) if not _same(a, b)]
    if "recv_x" in differ:
        from deepcomm.row_diff import differing_rows, explain_rows
        why = explain_rows(_values(got[0]), _values(want[0]), want[4].count_matrix[:, rank].tolist(),
                           [_values(e) for e in earlier])
        if expected is not None:
            rows = expected()
            why += (f"; against every rank's inputs drawn again here, {differing_rows(_values(got[0]), rows)} rows "
                    f"of this backend and {differing_rows(_values(want[0]), rows)} of the reference differ")
        differ[0] = f"recv_x ({why})"
    differ += [f"handle.{f}" for f in ("is_token_in_rank", "send_pos", "count_matrix", "recv_src_idx", "num_recv")
               if not _same(getattr(got[4], f), getattr(want[4], f))]
    n = got[4].num_recv
    y = torch.randn(n, case.hidden, generator=gen, device=device).to(torch.bfloat16)
    rw = torch.rand(n, case.topk, generator=gen, device=device)
    if not all(_same(a, b) for a, b in zip(buf.combine(y, got[4], topk_weights=rw),
                                           ref.combine(y, want[4], topk_weights=rw))):
        differ.append("combine")
    if case.hidden % 128 == 0 and not _same(buf.combine(y, got[4], use_fp8=True)[0],
                                            ref.combine(y, want[4], use_fp8=True)[0]):  # the FP8 combine, same rows
        differ.append("FP8 combine")
    return differ, flipped, (got[0], want[0])


def _placement(buf) -> str:
    """Where the Buffer's last dispatch put its rows (deepcomm.nvlink.backend.PLACEMENTS), as a mismatch line's
    suffix; empty for a backend that does not say."""
    placement = getattr(getattr(buf, "_backend", None), "last_placement", None)
    return f" (rows placed: {placement})" if placement else ""


def _arena_setting(buf) -> str:
    """The output arena's settings of a backend that has one (DEEPCOMM_ARENA_OUTPUTS, DEEPCOMM_ARENA_FULL), as the
    summary line's suffix; empty otherwise."""
    backend = getattr(buf, "_backend", None)
    if not hasattr(backend, "arena_outputs"):
        return ""
    return f" | arena: {backend.arena_outputs} worst-case outputs, full: {backend.arena_full}"


def _placements(buf) -> dict:
    """How many dispatches of the Buffer put their rows where (PLACEMENTS); empty for a backend that does not say."""
    return dict(getattr(getattr(buf, "_backend", None), "placements", {}))


def _let_go(kept: deque, keep: int, failures: list, rank: int) -> None:
    """Compare the kept outputs past the last ``keep`` with their references once more, then drop them."""
    while len(kept) > keep:
        it, (got, want), placed = kept.popleft()
        if not _same(got, want):
            failures.append(f"iteration {it} rank {rank}: a kept dispatch output changed after its call{placed}")


def _low_latency(buf, ref, case, x, idx, w, gen, device, world, corrupt):
    """``(outputs equal, a byte was corrupted)``."""
    import torch
    kw = dict(use_fp8=case.dtype != "bf16", use_ue8m0=case.dtype == "ue8m0")
    M = case.max_tokens
    got = buf.low_latency_dispatch(x, idx, M, case.experts, return_recv_hook=case.hook, **kw)
    got[3]()  # a no-op without the hook
    want = ref.low_latency_dispatch(x, idx, M, case.experts, **kw)
    ok = _same(got[1], want[1]) and all(_same(getattr(got[2], f), getattr(want[2], f))
                                        for f in ("src_info", "layout", "recv_pos"))
    parts_g = got[0] if isinstance(got[0], tuple) else (got[0],)
    parts_w = want[0] if isinstance(want[0], tuple) else (want[0],)
    flipped = False
    if corrupt and int(want[1].sum()):
        flipped = _flip_one_byte(parts_g[0][int((want[1] > 0).nonzero()[0, 0]), :1])
    for e, n in enumerate(want[1].tolist()):  # rows past the count are undefined
        ok &= all(_same(g[e, :n], v[e, :n]) for g, v in zip(parts_g, parts_w))
    y = torch.randn(case.experts // world, world * M, case.hidden, generator=gen, device=device).to(torch.bfloat16)
    out, hook = buf.low_latency_combine(y, idx, w, got[2], return_recv_hook=case.hook, use_fp8=case.combine_fp8)
    hook()
    ok &= _same(out, ref.low_latency_combine(y, idx, w, want[2], use_fp8=case.combine_fp8)[0])
    return ok, flipped


def run_worker(rank: int, world: int, local_rank: int, args, dev_type: str) -> int:
    import torch
    import torch.distributed as dist

    import deepcomm
    from deepcomm.backends import group_uses_nccl
    from deepcomm.reference.device_adapter import DeviceAdapter
    device = init_rank(rank, world, local_rank, dev_type)
    sizes = dict(max_tokens_per_rank=args.max_tokens, hidden=args.max_hidden,
                 num_max_low_latency_tokens=args.max_ll_tokens)
    on_gloo_gpu = device.type == "cuda" and not group_uses_nccl(dist.group.WORLD)  # ranks sharing a GPU
    backend = "cuda" if on_gloo_gpu and args.backend == "auto" else args.backend
    buf = deepcomm.Buffer(backend=backend, timeout_s=args.timeout_s, **sizes)
    # on a gloo group the reference runs on the CPU: the adapter moves its inputs there and its outputs back
    ref = DeviceAdapter(deepcomm.Buffer(backend="reference", **sizes), device)
    flag_device = "cpu" if on_gloo_gpu else device  # where the stop flag's all_reduce runs
    rng = random.Random(args.seed)  # the same shapes on every rank
    ll_shape, ll_left = None, 0
    gen = torch.Generator(device=device)
    counts, failures = Counter(), []
    kept = deque()  # (iteration, (received, reference), placement) of the last --keep normal-mode dispatches
    to_corrupt = args.self_check and rank == 0  # once, in the first iteration past the middle that has data
    start = time.monotonic()
    for it in range(args.iterations):
        if args.seconds > 0:
            stop = torch.tensor([time.monotonic() - start > args.seconds], device=flag_device)
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every rank stops at the same iteration
            if bool(stop):
                break
        if ll_left == 0:
            ll_shape, ll_left = draw_ll_shape(rng, world, args), max(1, args.ll_shape_every)
        case = Case(rng, world, args, ll_shape)
        ll_left -= case.mode == "low_latency"
        seed = _seed(args, it, rank)
        gen.manual_seed(seed)
        x, idx, w = _inputs(case, random.Random(seed), gen, device)
        if args.progress and rank == 0:
            print(f"iteration {it} at {time.monotonic() - start:.1f} s: {case.label()} T={x.shape[0]} "
                  f"H={case.hidden} E={case.experts} K={case.topk} mask={case.mask}", flush=True)
        corrupt = to_corrupt and it >= args.iterations // 2
        if case.mode == "normal":
            differ, flipped, rows = _normal(
                buf, ref, case, x, idx, w, gen, device, corrupt, rank, [got for _, (got, _), _ in kept],
                lambda: _expected_recv(case, args, it, world, rank, device))
            ok = not differ
            placed = _placement(buf)
            if args.keep > 0 and ok:
                kept.append((it, rows, placed))
                _let_go(kept, args.keep, failures, rank)
        else:
            differ, placed = [], ""
            ok, flipped = _low_latency(buf, ref, case, x, idx, w, gen, device, world, corrupt)
        to_corrupt &= not flipped
        counts[case.label()] += 1
        if not ok:
            failures.append(f"iteration {it} rank {rank}: {case.label()} T={x.shape[0]} H={case.hidden} "
                            f"E={case.experts} K={case.topk} mask={case.mask}"
                            + (f": {', '.join(differ)} differ" if differ else "") + placed)
    _let_go(kept, 0, failures, rank)
    buf.synchronize()
    every = [None] * world
    dist.all_gather_object(every, (counts, failures, _placements(buf)))
    if rank == 0:
        total, all_failures, landed = Counter(), [], Counter()
        for c, f, p in every:
            total.update(c)
            all_failures += f
            landed.update(p)
        print(f"deepcomm soak | backend {buf.backend_name} | world_size {world} | "
              f"{sum(total.values()) // world} iterations in {time.monotonic() - start:.1f} s{_arena_setting(buf)}")
        for label in sorted(total):
            print(f"  {label:22s} {total[label] // world:7d}")
        if landed:  # where the dispatches' rows landed, all ranks (the bounce area once the arena is full)
            print("  dispatch rows placed   " + ", ".join(f"{k} {v}" for k, v in landed.items()) + " (all ranks)")
        print(f"  mismatches             {len(all_failures):7d}")
        for line in all_failures[:20]:
            print("  " + line)
    failed = any(f for _, f, _ in every)
    buf.destroy()
    ref.destroy()
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    dev_type = device_type(args.device)
    if dev_type == "cpu" and args.backend == "cuda":
        raise SystemExit("--backend cuda: needs GPUs")
    import torch
    world = args.world_size or (torch.cuda.device_count() if dev_type == "cuda" else 2)
    return launch(run_worker, args, dev_type, world, "deepcomm-soak")


if __name__ == "__main__":
    sys.exit(main())
