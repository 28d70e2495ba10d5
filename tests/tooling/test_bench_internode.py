"""The benchmark's internode mode (CPU): its command line, its cases and the mode its results are reported as."""
from __future__ import annotations

import pytest

from deepcomm.bench.cli import _make_cases, build_parser, resolve_defaults
from deepcomm.bench.peers import Case, reported_mode
from deepcomm.config import Config


def _args(argv, device="cuda"):
    return resolve_defaults(build_parser().parse_args(argv), device)


def test_internode_mode_runs_alone_and_on_gpus():
    with pytest.raises(SystemExit, match="internode runs alone"):
        _args(["--modes", "internode,normal"])
    with pytest.raises(SystemExit, match="needs --device cuda"):
        _args(["--modes", "internode"], device="cpu")
    with pytest.raises(SystemExit, match="gpus-per-node"):
        _args(["--modes", "internode", "--gpus-per-node", "0"])
    args = _args(["--modes", "internode", "--gpus-per-node", "1", "--tokens", "64,512"])
    assert args.gpus_per_node == 1 and args.tokens == [64, 512]


def test_internode_cases_and_reported_mode():
    class FakeDc:
        name, uses_sms, backend_name = "deepcomm", True, "cuda"

        def supports(self, mode, op, dtype):
            return True

    class FakeA2a:
        name = "nccl-a2a"

        def supports(self, mode, op, dtype):
            return True

    dc = FakeDc()
    args = _args(["--modes", "internode", "--tokens", "64", "--num-sms", "8,24", "--dtypes", "bf16"])
    cases = _make_cases(args, [dc, FakeA2a()], dc)
    got = {(c.system, c.mode, c.op, c.num_sms) for c in cases}
    # normal-mode workloads, no num_sms sweep (one posting and one NIC block per peer)
    assert got == {(s, "internode", op, None) for s in ("deepcomm", "nccl-a2a") for op in ("dispatch", "combine")}
    assert reported_mode(Case("deepcomm", "internode", "dispatch", "bf16", 64), dc) == "internode-emulated"
    dc.buf = type("FakeBuffer", (), {"config": Config(internode_transport="nvshmem")})()
    assert reported_mode(Case("deepcomm", "internode", "dispatch", "bf16", 64), dc) == "internode-nvshmem"
    del dc.buf
    assert reported_mode(Case("nccl-a2a", "internode", "dispatch", "bf16", 64), dc) == "normal"
    assert reported_mode(Case("deepcomm", "normal", "dispatch", "bf16", 64), dc) == "normal"
    dc.backend_name = "reference"
    assert reported_mode(Case("deepcomm", "internode", "dispatch", "bf16", 64), dc) == "internode-reference"
