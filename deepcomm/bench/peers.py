"""The systems a benchmark run compares (docs/benchmarks/README.md, "Peers").

Each system answers `supports(mode, op, dtype)` and `prepare(case, inputs)`; prepare does all set-up
(permutations, FP8 casts, a first dispatch whose handle a combine reuses) and returns the zero-argument
callable that the timer calls back to back.

- AllToAll      `nccl-a2a` (`gloo-a2a` on CPU): all_to_all_single on pre-permuted buffers of the same bytes
                as the dispatch (reverse direction for combine): the raw transport bound.
- MoELayer      `nccl-moe-layer` (`gloo-moe-layer` on CPU): what MoE code writes with torch.distributed and
                no EP library: count exchange (+ host sync), permute, all-to-all of rows and routing,
                un-permute (global -> local expert ids, tokens per expert); combine = all-to-all back and
                an fp32 index_add into token order. BF16 only, like the documented peer.
- Deepcomm      deepcomm.Buffer: normal dispatch/combine, low-latency dispatch/combine, num_sms sweep.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from deepcomm.bench.metrics import row_bytes
from deepcomm.bench.workloads import Inputs, token_in_rank


@dataclass(frozen=True)
class Case:
    system: str
    mode: str            # normal | low_latency | internode (normal-mode workloads, multi-node topology)
    op: str              # dispatch | combine
    dtype: str           # fp8 | bf16
    tokens: int
    num_sms: Optional[int] = None   # None = the system's default
    timing: str = "eager"           # eager: back-to-back calls; cuda-graph: replays of one captured call

    def label(self) -> str:
        sms = f" sms={self.num_sms}" if self.num_sms is not None else ""
        graph = " graph" if self.timing == "cuda-graph" else ""
        return f"{self.system} {self.mode} {self.op} {self.dtype} T={self.tokens}{sms}{graph}"


@dataclass
class Context:
    rank: int
    world_size: int
    device: torch.device
    group: object
    dist_backend: str    # nccl | gloo
    hidden: int
    topk: int
    experts: int


class AllToAll:
    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.name = f"{ctx.dist_backend}-a2a"

    def supports(self, mode: str, op: str, dtype: str) -> bool:
        # FP8 combine rows exist in normal mode only (deepcomm's use_fp8); the bytes bound is the same here
        return op == "dispatch" or dtype == "bf16" or mode == "normal"

    def reported_num_sms(self, case: Case):
        return None

    def prepare(self, case: Case, inp: Inputs) -> Callable[[], object]:
        c = self.ctx
        send, recv = inp.send_counts(c.rank), inp.recv_counts(c.rank)
        if case.op == "combine":
            send, recv = recv, send
        rb = row_bytes(c.hidden, case.dtype)
        send_buf = torch.randint(0, 256, (sum(send), rb), dtype=torch.uint8, device=c.device)
        recv_buf = torch.empty(sum(recv), rb, dtype=torch.uint8, device=c.device)
        group = c.group

        def run():
            dist.all_to_all_single(recv_buf, send_buf, recv, send, group=group)
            return recv_buf
        return run


class MoELayer:
    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.name = f"{ctx.dist_backend}-moe-layer"

    def supports(self, mode: str, op: str, dtype: str) -> bool:
        return dtype == "bf16"

    def reported_num_sms(self, case: Case):
        return None

    def dispatch(self, x, topk_idx, topk_weights):
        """Returns (recv_x, recv_topk_idx, recv_topk_weights, tokens_per_local_expert, route)."""
        c = self.ctx
        R, E, K = c.world_size, c.experts, topk_idx.shape[1]
        L = E // R
        # count exchange: how many tokens go to each rank, and how many arrive (host sync for the splits)
        in_rank = token_in_rank(topk_idx, E, R)
        send_counts = in_rank.sum(0).to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=c.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        # permute: rows grouped by destination rank, in token order
        _, src_tok = in_rank.t().nonzero(as_tuple=True)
        send_x = x.index_select(0, src_tok)
        meta = torch.cat([topk_idx.to(torch.int32), topk_weights.view(torch.int32)], dim=1)
        send_meta = meta.index_select(0, src_tok)
        # all-to-all of the rows and of the routing
        recv_x = x.new_empty(sum(recv), x.shape[1])
        dist.all_to_all_single(recv_x, send_x, recv, send, group=c.group)
        recv_meta = meta.new_empty(sum(recv), 2 * K)
        dist.all_to_all_single(recv_meta, send_meta, recv, send, group=c.group)
        # un-permute: global -> local expert ids, weights of other ranks' experts zeroed, tokens per expert
        local = recv_meta[:, :K].to(torch.int64) - c.rank * L
        mine = (local >= 0) & (local < L)
        recv_idx = torch.where(mine, local, torch.full_like(local, -1))
        recv_w = torch.where(mine, recv_meta[:, K:].contiguous().view(torch.float32), 0.0)
        per_expert = torch.bincount(recv_idx[mine], minlength=L).tolist()
        return recv_x, recv_idx, recv_w, per_expert, (src_tok, send, recv, x.shape[0])

    def combine(self, x, route):
        src_tok, send, recv, num_tokens = route
        back = x.new_empty(sum(send), x.shape[1])
        dist.all_to_all_single(back, x, send, recv, group=self.ctx.group)
        out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, src_tok, back.float())
        return out.to(x.dtype)

    def prepare(self, case: Case, inp: Inputs) -> Callable[[], object]:
        x, idx, w = inp.x, inp.topk_idx, inp.topk_weights
        if case.op == "dispatch":
            return lambda: self.dispatch(x, idx, w)
        recv_x, _, _, _, route = self.dispatch(x, idx, w)
        return lambda: self.combine(recv_x, route)


class Deepcomm:
    name = "deepcomm"

    def __init__(self, ctx: Context, max_tokens: int, ll_tokens: int, backend: str,
                 gpus_per_node: Optional[int] = None):
        import deepcomm  # noqa: F401  (fails here, not mid-run, when the package is missing)

        self.ctx = ctx
        self.ll_tokens = ll_tokens
        self._kwargs = dict(max_tokens_per_rank=max_tokens, hidden=ctx.hidden, backend=backend,
                            num_max_low_latency_tokens=ll_tokens)
        if gpus_per_node is not None:
            self._kwargs["gpus_per_node"] = gpus_per_node
        self.buf = deepcomm.Buffer(ctx.group, num_sms=None, **self._kwargs)
        self.backend_name = getattr(self.buf, "backend_name", backend)
        topology = getattr(self.buf, "topology", None)
        self.is_internode = bool(topology is not None and topology.is_internode)
        self.default_num_sms = getattr(self.buf, "num_sms", None)
        self._sweep_bufs = {}

    def close(self) -> None:
        for b in [self.buf, *self._sweep_bufs.values()]:
            if hasattr(b, "destroy"):
                b.destroy()
        self._sweep_bufs.clear()

    @property
    def uses_sms(self) -> bool:
        return self.backend_name != "reference"

    def supports(self, mode: str, op: str, dtype: str) -> bool:
        return True

    def reported_num_sms(self, case: Case):
        if not self.uses_sms:
            return None
        if case.mode == "low_latency":  # one block per SM, or DEEPCOMM_LL_NUM_SMS (tuning.md); num_sms is normal mode's
            ll = getattr(self.buf._backend, "ll", None)  # the CUDA backends' low-latency part (internode: its engine)
            return getattr(getattr(ll, "engine", ll), "blocks", None)
        return case.num_sms if case.num_sms is not None else self.default_num_sms

    def _buffer(self, num_sms):
        """The buffer set to `num_sms` (None = default): set_num_sms when offered, else one Buffer each."""
        import deepcomm

        if hasattr(self.buf, "set_num_sms"):
            target = num_sms if num_sms is not None else self.default_num_sms
            if target is not None:
                self.buf.set_num_sms(target)
            return self.buf
        if num_sms is None:
            return self.buf
        if num_sms not in self._sweep_bufs:
            self._sweep_bufs[num_sms] = deepcomm.Buffer(self.ctx.group, num_sms=num_sms, **self._kwargs)
        return self._sweep_bufs[num_sms]

    def prepare(self, case: Case, inp: Inputs) -> Callable[[], object]:
        from deepcomm.fp8 import per_token_cast_to_fp8

        buf = self._buffer(case.num_sms)
        E = self.ctx.experts
        x, idx, w = inp.x, inp.topk_idx, inp.topk_weights
        if case.mode in ("normal", "internode"):
            if case.op == "dispatch":
                x_in = per_token_cast_to_fp8(x) if case.dtype == "fp8" else x
                return lambda: buf.dispatch(x_in, topk_idx=idx, topk_weights=w, num_experts=E)
            recv_x, _, _, _, handle = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
            fp8 = case.dtype == "fp8"
            return lambda: buf.combine(recv_x, handle, use_fp8=fp8)
        M = self.ll_tokens
        fp8 = case.dtype == "fp8"
        if case.op == "dispatch":
            fn = lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=fp8)  # noqa: E731
        elif case.op == "combine":
            recv_x, _, handle, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
            fn = lambda: buf.low_latency_combine(recv_x, idx, w, handle, use_fp8=fp8)  # noqa: E731
        else:  # dispatch+combine: the decoding step's communication, expert outputs standing in as bf16
            L, R = E // self.ctx.world_size, self.ctx.world_size
            y = torch.randn(L, R * M, self.ctx.hidden, device=self.ctx.device).to(torch.bfloat16)

            def fn():
                _, _, h, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=fp8)
                return buf.low_latency_combine(y, idx, w, h)
        return replay_graph(fn) if case.timing == "cuda-graph" else fn

    def hook_overlap(self, inp: Inputs, dtype: str, pairs: int = 20) -> dict:
        """A matmul launched between a low-latency dispatch's send and its hook, timed alone and in that spot.
        Equal times mean the pending dispatch holds no SM. The two are timed in alternation, so that clock and
        power drift over the run (a long matmul loop slows the GPU down) falls on both alike."""
        buf = self._buffer(None)
        M, E, dev = self.ll_tokens, self.ctx.experts, self.ctx.device
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        fp8 = dtype == "fp8"
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def timed(with_dispatch: bool) -> float:
            hook = None
            if with_dispatch:
                hook = buf.low_latency_dispatch(inp.x, inp.topk_idx, M, E, use_fp8=fp8, return_recv_hook=True)[3]
            start.record()
            a @ a
            end.record()
            if hook is not None:
                hook()
            torch.cuda.synchronize(dev)
            return start.elapsed_time(end) * 1e3

        for _ in range(3):  # warm-up
            timed(False), timed(True)
        alone, pending = [], []
        for i in range(pairs):  # which goes first alternates too
            first = bool(i % 2)
            t_first, t_second = timed(first), timed(not first)
            (pending if first else alone).append(t_first)
            (alone if first else pending).append(t_second)
        ratios = sorted(p / a for a, p in zip(alone, pending))
        return {"compute_alone_us": statistics.median(alone), "compute_with_send_pending_us": statistics.median(pending),
                "pending_over_alone_median": ratios[len(ratios) // 2], "pairs": pairs}

    def fp8_combine_errors(self, case: Case, inp: Inputs) -> tuple[float, float, float]:
        """This rank's ``metrics.combine_errors`` of the FP8 combine against the BF16 combine of the same expert
        outputs (the dispatched rows, scaled per row so that blocks differ in magnitude)."""
        from deepcomm.bench.metrics import combine_errors

        buf = self._buffer(case.num_sms)
        if case.mode == "low_latency":
            M, E = self.ll_tokens, self.ctx.experts
            recv_x, _, handle, _ = buf.low_latency_dispatch(inp.x, inp.topk_idx, M, E, use_fp8=False)
            y = (recv_x.float() * torch.linspace(0.5, 2.0, recv_x.shape[1], device=recv_x.device)[None, :, None])
            y = y.to(torch.bfloat16)
            got, _ = buf.low_latency_combine(y, inp.topk_idx, inp.topk_weights, handle, use_fp8=True)
            want, _ = buf.low_latency_combine(y, inp.topk_idx, inp.topk_weights, handle)
            return combine_errors(got, want)
        recv_x, _, _, _, handle = buf.dispatch(inp.x, topk_idx=inp.topk_idx, topk_weights=inp.topk_weights,
                                               num_experts=self.ctx.experts)
        y = (recv_x.float() * torch.linspace(0.5, 2.0, recv_x.shape[0], device=recv_x.device)[:, None])
        y = y.to(torch.bfloat16)
        got, _ = buf.combine(y, handle, use_fp8=True)
        want, _ = buf.combine(y, handle)
        return combine_errors(got, want)


def reported_mode(case: Case, dc: Optional[Deepcomm]) -> str:
    """The result's `mode` (docs/benchmarks/README.md): deepcomm's internode runs on the CUDA backend are
    "internode-<transport>" ("internode-emulated", or "internode-nvshmem" with DEEPCOMM_INTERNODE_TRANSPORT=nvshmem);
    the peers in such a run are plain NCCL collectives, reported as "normal"."""
    if case.mode != "internode":
        return case.mode
    if case.system == "deepcomm" and dc is not None and dc.backend_name == "cuda":
        config = getattr(getattr(dc, "buf", None), "config", None)
        return "internode-" + getattr(config, "internode_transport", "emulated")
    return "normal" if case.system != "deepcomm" else "internode-reference"


GRAPH_CALLS = 10  # calls captured back to back in one graph: the graph's own launch cost is spread over them


def capture_graph(step: Callable[[], object], calls: int = 1):
    """Warm ``step()`` up on a side stream, then capture ``calls`` calls of it in one CUDA graph: ``(graph, the
    last call's outputs)`` (the tests replay it with new inputs copied into the captured ones)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    out = None
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = step()
    return graph, out


def replay_graph(fn: Callable[[], object], calls: int = GRAPH_CALLS) -> Callable[[], object]:
    """Capture ``calls`` calls of ``fn`` in one CUDA graph (capture_graph) and return its replay, marked with
    ``.calls`` so the harness reports time per call: the kernels' time without the host's."""
    graph, _ = capture_graph(fn, calls)

    def replay():
        graph.replay()
    replay.calls = calls
    return replay


def check_against_moe_layer(dc: Deepcomm, moe: MoELayer, inp: Inputs) -> None:
    """deepcomm's BF16 dispatch/combine must equal the plain MoE layer's (same rows, same order)."""
    want_x, want_idx, want_w, want_counts, route = moe.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
    got_x, got_idx, got_w, got_counts, handle = dc.buf.dispatch(
        inp.x, topk_idx=inp.topk_idx, topk_weights=inp.topk_weights, num_experts=dc.ctx.experts)
    where = f"rank {dc.ctx.rank}, T={inp.x.shape[0]}"
    if not torch.equal(got_x, want_x):
        raise AssertionError(f"check: dispatch recv_x differs from the MoE layer's ({where})")
    if not torch.equal(got_idx, want_idx):
        raise AssertionError(f"check: dispatch recv_topk_idx differs ({where})")
    if not torch.equal(got_w, want_w):
        raise AssertionError(f"check: dispatch recv_topk_weights differs ({where})")
    if list(got_counts) != list(want_counts):
        raise AssertionError(f"check: tokens per local expert differ ({where})")
    y = (got_x.float() * 0.5).to(torch.bfloat16)
    got, _ = dc.buf.combine(y, handle)
    want = moe.combine(y, route)
    if not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2):
        raise AssertionError(f"check: combine differs from the MoE layer's ({where})")
