"""DeepEP V1 as a benchmark peer (deepcomm/bench/deepep_peer.py), on the CPU with a stand-in for DeepEP's
package: which deep_ep counts as DeepEP, the calls each case times (DeepEP's own API, in its argument order and
return layout), what it supports, and the cases the command line makes for it (num_sms sweep, CUDA graphs)."""
from __future__ import annotations

import sys
import types

import torch

from deepcomm.bench import deepep_peer
from deepcomm.bench.cli import _make_cases, build_parser, resolve_defaults
from deepcomm.bench.deepep_peer import DeepEP, find_deep_ep
from deepcomm.bench.peers import Case, Context


class _Config:
    def __init__(self, num_sms, kind):
        self.num_sms, self.kind = num_sms, kind

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        return hidden_bytes * num_ranks * (1000 if self.kind == "dispatch" else 2000)


def _fake_deep_ep(calls):
    """A module with DeepEP V1's Buffer surface that records each call."""
    class Buffer:
        num_sms = 20

        def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                     explicitly_destroy=False):
            assert explicitly_destroy  # the peer frees its buffers itself (close)
            calls.append(("Buffer", num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank))

        def destroy(self):
            calls.append(("destroy",))

        @staticmethod
        def set_num_sms(n):
            assert n % 2 == 0
            Buffer.num_sms = n

        @staticmethod
        def get_dispatch_config(num_ranks):
            return _Config(Buffer.num_sms, "dispatch")

        @staticmethod
        def get_combine_config(num_ranks):
            return _Config(Buffer.num_sms, "combine")

        @staticmethod
        def get_low_latency_rdma_size_hint(M, hidden, num_ranks, num_experts):
            return M * hidden * num_ranks * num_experts

        def get_dispatch_layout(self, topk_idx, num_experts):
            calls.append(("layout", num_experts))
            R = 2
            return (torch.zeros(R), None, torch.zeros(num_experts), torch.zeros(topk_idx.shape[0], R, dtype=torch.bool),
                    "event")

        def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                     is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                     expert_alignment=1, num_worst_tokens=0, config=None):
            calls.append(("dispatch", isinstance(x, tuple), config.kind, config.num_sms, topk_idx is not None))
            values = x[0] if isinstance(x, tuple) else x
            return values, topk_idx, topk_weights, [1], ("handle",), "event"

        def combine(self, x, handle, topk_weights=None, bias=None, config=None):
            calls.append(("combine", handle, config.kind, config.num_sms))
            return x, None, "event"

        def low_latency_dispatch(self, x, topk_idx, M, E, use_fp8=True):
            calls.append(("ll_dispatch", M, E, use_fp8))
            return "recv", "count", ("ll_handle",), "event", "hook"

        def low_latency_combine(self, x, topk_idx, topk_weights, handle):
            calls.append(("ll_combine", x, handle))
            return "out", "event", "hook"

    return types.SimpleNamespace(Buffer=Buffer, __file__="/site-packages/deep_ep/__init__.py")


def _ctx(device="cuda", backend="nccl"):
    return Context(rank=0, world_size=2, device=types.SimpleNamespace(type=device), group=None,
                   dist_backend=backend, hidden=256, topk=2, experts=8)


def _inputs(T=4):
    return types.SimpleNamespace(x=torch.randn(T, 256).to(torch.bfloat16), topk_idx=torch.zeros(T, 2, dtype=torch.int64),
                                 topk_weights=torch.rand(T, 2))


def test_only_the_real_deep_ep_counts(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # import fails
    module, why = find_deep_ep()
    assert module is None and "not importable" in why
    from deepcomm.compat import deep_ep as shim
    monkeypatch.setitem(sys.modules, "deep_ep", shim)
    module, why = find_deep_ep()
    assert module is None and "shim" in why
    fake = _fake_deep_ep([])
    monkeypatch.setitem(sys.modules, "deep_ep", fake)
    assert find_deep_ep() == (fake, "")


def test_supports_what_deepep_has():
    peer = DeepEP(_ctx(), _fake_deep_ep([]), 4096, 128, 25)
    assert peer.default_num_sms == 24  # DeepEP takes even SM counts
    assert peer.supports("normal", "dispatch", "fp8") and peer.supports("low_latency", "combine", "bf16")
    assert not peer.supports("normal", "combine", "fp8")  # no FP8 combine in DeepEP
    assert not peer.supports("internode", "dispatch", "bf16")
    assert not DeepEP(_ctx(device="cpu", backend="gloo"), _fake_deep_ep([]), 64, 8, 24).supports(
        "normal", "dispatch", "bf16")


def test_normal_cases_time_layout_and_dispatch_then_combine_along_a_handle():
    calls = []
    peer = DeepEP(_ctx(), _fake_deep_ep(calls), 4096, 128, 24)
    fn = peer.prepare(Case("deepep-v1", "normal", "dispatch", "fp8", 4, num_sms=8), _inputs())
    assert calls[0][0] == "Buffer" and calls[0][1] == 256 * 2 * 2 * 2000  # the larger of the two hints
    calls.clear()
    fn()
    assert calls == [("layout", 8), ("dispatch", True, "dispatch", 8, True)]
    assert peer.reported_num_sms(Case("deepep-v1", "normal", "dispatch", "fp8", 4, num_sms=8)) == 8
    calls.clear()
    fn = peer.prepare(Case("deepep-v1", "normal", "combine", "bf16", 4), _inputs())
    assert [c[0] for c in calls] == ["layout", "dispatch"]  # one BF16 dispatch for the handle, not timed
    calls.clear()
    fn()
    assert calls == [("combine", ("handle",), "combine", 24)]


def test_low_latency_cases_use_their_own_buffer():
    calls = []
    peer = DeepEP(_ctx(), _fake_deep_ep(calls), 4096, 128, 24)
    fn = peer.prepare(Case("deepep-v1", "low_latency", "dispatch", "fp8", 128), _inputs(128))
    assert calls[0] == ("Buffer", 0, 128 * 256 * 2 * 8, True, 4)  # low-latency mode, one QP per local expert
    fn()
    assert calls[-1] == ("ll_dispatch", 128, 8, True)
    fn = peer.prepare(Case("deepep-v1", "low_latency", "combine", "bf16", 128), _inputs(128))
    fn()
    assert calls[-2] == ("ll_dispatch", 128, 8, False) and calls[-1] == ("ll_combine", "recv", ("ll_handle",))
    assert peer.reported_num_sms(Case("deepep-v1", "low_latency", "combine", "bf16", 128)) is None
    peer.close()
    assert calls[-1] == ("destroy",)


def test_command_line_cases_for_deepep():
    args = resolve_defaults(build_parser().parse_args(
        ["--systems", "deepcomm,deepep", "--tokens", "4096", "--num-sms", "8,24", "--ll-tokens", "128",
         "--dtypes", "bf16"]), "cuda")

    class FakeDc:
        name, uses_sms = "deepcomm", True

        def supports(self, mode, op, dtype):
            return True

    peer = DeepEP(_ctx(), _fake_deep_ep([]), 4096, 128, 24)
    cases = _make_cases(args, [FakeDc(), peer], FakeDc())
    mine = [c for c in cases if c.system == "deepep-v1"]
    assert {c.num_sms for c in mine if c.mode == "normal"} == {None, 8, 24}
    assert {(c.op, c.timing) for c in mine if c.mode == "low_latency"} == {
        ("dispatch", "eager"), ("combine", "eager"), ("dispatch", "cuda-graph"), ("combine", "cuda-graph")}
    assert deepep_peer.DeepEP.name == "deepep-v1"
