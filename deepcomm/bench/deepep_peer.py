"""DeepEP V1 as a benchmark peer (`deepep-v1`), timed by the same harness in the same run as deepcomm, where the
real DeepEP is importable (`import deep_ep`; deepcomm's own DeepEP shim, deepcomm.compat.deep_ep, is not it).

What is timed is what a DeepEP user's MoE layer calls, with DeepEP's default configs for the world size
(`Buffer.get_dispatch_config` / `get_combine_config`) at the case's SM count (`Buffer.set_num_sms`):
- normal dispatch: `get_dispatch_layout` then `dispatch` with the layout, top-k ids and weights (deepcomm's fresh
  dispatch does both in one call); FP8 as DeepEP takes it, e4m3 values with one fp32 scale per 128;
- normal combine: `combine` along the handle of one BF16 dispatch (DeepEP has no FP8 combine);
- low-latency dispatch (FP8 or BF16) and BF16 combine, eager or replayed from a CUDA graph.
One process per GPU over NCCL, one node (intranode kernels); low-latency mode needs DeepEP built with NVSHMEM.
"""
from __future__ import annotations

import os
from typing import Callable, Optional, Tuple


from deepcomm.bench.peers import Case, Context, replay_graph
from deepcomm.bench.workloads import Inputs


def find_deep_ep() -> Tuple[Optional[object], str]:
    """``(module, "")`` for an importable real DeepEP, else ``(None, why not)``."""
    try:
        import deep_ep
    except ImportError as e:
        return None, f"deep_ep is not importable ({e})"
    if getattr(deep_ep, "__deepcomm_shim__", False) or os.sep + "deepcomm" + os.sep in (
            getattr(deep_ep, "__file__", "") or ""):
        return None, "deep_ep is deepcomm's own DeepEP shim, not DeepEP"
    if not hasattr(deep_ep, "Buffer") or not hasattr(deep_ep.Buffer, "get_dispatch_config"):
        return None, "deep_ep has no Buffer.get_dispatch_config (not DeepEP V1)"
    return deep_ep, ""


class DeepEP:
    name = "deepep-v1"
    uses_sms = True     # normal mode takes part in the num_sms sweep
    graph_timing = True  # low-latency calls are also timed as CUDA-graph replays

    def __init__(self, ctx: Context, module, max_tokens: int, ll_tokens: int, default_num_sms: int):
        self.ctx, self.ep = ctx, module
        self.max_tokens, self.ll_tokens = max_tokens, ll_tokens
        self.default_num_sms = default_num_sms - default_num_sms % 2  # DeepEP takes even SM counts
        self._normal = None
        self._low_latency = None

    def close(self) -> None:
        for buf in (self._normal, self._low_latency):
            if buf is not None:
                buf.destroy()  # made with explicitly_destroy=True: freed now, not at interpreter exit
        self._normal = self._low_latency = None

    def supports(self, mode: str, op: str, dtype: str) -> bool:
        if self.ctx.device.type != "cuda" or self.ctx.dist_backend != "nccl" or mode not in ("normal", "low_latency"):
            return False
        return not (op == "combine" and dtype == "fp8")  # DeepEP combines in BF16 only

    def reported_num_sms(self, case: Case):
        if case.mode == "low_latency":
            return None  # DeepEP's low-latency kernels size their own grid
        return case.num_sms if case.num_sms is not None else self.default_num_sms

    def _normal_buffer(self):
        if self._normal is None:
            R, hidden_bytes = self.ctx.world_size, self.ctx.hidden * 2
            Buffer = self.ep.Buffer
            nvl = max(Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(hidden_bytes, R),
                      Buffer.get_combine_config(R).get_nvl_buffer_size_hint(hidden_bytes, R))
            self._normal = Buffer(self.ctx.group, nvl, 0, explicitly_destroy=True)
        return self._normal

    def _low_latency_buffer(self):
        if self._low_latency is None:
            R, E = self.ctx.world_size, self.ctx.experts
            rdma = self.ep.Buffer.get_low_latency_rdma_size_hint(self.ll_tokens, self.ctx.hidden, R, E)
            self._low_latency = self.ep.Buffer(self.ctx.group, 0, rdma, low_latency_mode=True,
                                               num_qps_per_rank=E // R, explicitly_destroy=True)
        return self._low_latency

    def _configs(self, num_sms: Optional[int]):
        n = num_sms if num_sms is not None else self.default_num_sms
        self.ep.Buffer.set_num_sms(n - n % 2)
        R = self.ctx.world_size
        return self.ep.Buffer.get_dispatch_config(R), self.ep.Buffer.get_combine_config(R)

    def prepare(self, case: Case, inp: Inputs) -> Callable[[], object]:
        from deepcomm.fp8 import per_token_cast_to_fp8

        E, x, idx, w = self.ctx.experts, inp.x, inp.topk_idx, inp.topk_weights
        fp8 = case.dtype == "fp8"
        if case.mode == "normal":
            buf = self._normal_buffer()
            dispatch_config, combine_config = self._configs(case.num_sms)

            def dispatch(payload):
                per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
                return buf.dispatch(payload, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                    num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w,
                                    config=dispatch_config)
            if case.op == "dispatch":
                payload = per_token_cast_to_fp8(x) if fp8 else x
                return lambda: dispatch(payload)
            recv_x, _, _, _, handle, _ = dispatch(x)
            return lambda: buf.combine(recv_x, handle, config=combine_config)
        buf, M = self._low_latency_buffer(), self.ll_tokens
        if case.op == "dispatch":
            fn = lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=fp8)  # noqa: E731
        else:
            recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
            fn = lambda: buf.low_latency_combine(recv_x, idx, w, handle)  # noqa: E731
        return replay_graph(fn) if case.timing == "cuda-graph" else fn
