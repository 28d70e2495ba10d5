"""The bench's FP8-combine pieces, without timing anything: byte counts, the error metric, its place in the
result file, the cases a run makes, and the error of a real FP8 combine on 2 CPU ranks (reference backend)."""
import json

import pytest
import torch

from tests.helpers.multiproc import run_ranks


def test_combine_bytes_follow_the_dtype():
    from deepcomm.bench.metrics import logical_bytes
    assert logical_bytes(10, 7168, "combine", "bf16") == 10 * 7168 * 2
    assert logical_bytes(10, 7168, "combine", "fp8") == 10 * (7168 + 56 * 4)
    assert logical_bytes(10, 7168, "combine", "fp8") == logical_bytes(10, 7168, "dispatch", "fp8")
    with pytest.raises(ValueError, match="op"):
        logical_bytes(1, 128, "gather", "bf16")


def test_combine_errors_by_hand():
    from deepcomm.bench.metrics import combine_errors
    want = torch.tensor([[1.0, -4.0, 2.0], [0.0, 0.0, 0.0], [8.0, 8.0, 8.0]])
    got = want + torch.tensor([[0.5, 0.0, 0.0], [0.0, 0.25, 0.0], [0.0, -1.0, 0.0]])
    max_rel, err, ref = combine_errors(got, want)
    # per token: 0.5 / 4, 0.25 / (all-zero row: absolute), 1 / 8
    assert max_rel == pytest.approx(0.25)
    assert (err, ref) == (pytest.approx(1.75), pytest.approx(31.0))
    assert combine_errors(want, want) == (0.0, 0.0, pytest.approx(31.0))
    assert combine_errors(torch.zeros(0, 4), torch.zeros(0, 4)) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="got"):
        combine_errors(torch.zeros(2, 3), torch.zeros(3, 2))


def test_error_keys_only_on_results_that_have_them(tmp_path):
    from deepcomm.bench import report
    base = dict(system="deepcomm", mode="normal", op="combine", tokens=8, hidden=256, topk=2, experts=4,
                num_sms=None, time_us=1.0, median_us=1.0, gbps=1.0)
    results = [dict(base, dtype="bf16"), dict(base, dtype="fp8", max_rel_err=0.03, mean_rel_err=0.01)]
    doc = report.make_document(results, "cpu", 2, "reference")
    assert "max_rel_err" not in doc["results"][0]
    assert doc["results"][1]["max_rel_err"] == 0.03 and doc["results"][1]["mean_rel_err"] == 0.01
    path = tmp_path / "run.json"
    report.write_json(doc, str(path))
    assert json.loads(path.read_text())["results"][1]["mean_rel_err"] == 0.01
    report.write_csv(doc["results"], str(tmp_path / "run.csv"))
    lines = (tmp_path / "run.csv").read_text().splitlines()
    assert lines[0].endswith("max_rel_err,mean_rel_err") and lines[1].endswith(",,")
    assert "3.00e-02" in report.format_table(doc["results"])


def test_cases_have_fp8_combine_in_normal_mode_only():
    from deepcomm.bench.cli import _make_cases, build_parser, resolve_defaults

    class FakeDc:
        name, uses_sms = "deepcomm", True

        def supports(self, mode, op, dtype):
            return not (mode == "low_latency" and op == "combine" and dtype == "fp8")

    args = resolve_defaults(build_parser().parse_args(["--tokens", "64", "--num-sms", "8,24"]), "cuda")
    cases = {(c.mode, c.op, c.dtype, c.num_sms) for c in _make_cases(args, [FakeDc()], FakeDc())}
    assert ("normal", "combine", "fp8", None) in cases and ("normal", "combine", "fp8", 24) in cases
    assert ("low_latency", "combine", "fp8", None) not in cases
    assert ("low_latency", "combine", "bf16", None) in cases


def _errors_worker(rank, world):
    import torch.distributed as dist

    from deepcomm.bench.peers import Case, Context, Deepcomm
    from deepcomm.bench.workloads import Workload, make_inputs

    ctx = Context(rank=rank, world_size=world, device=torch.device("cpu"), group=dist.group.WORLD,
                  dist_backend="gloo", hidden=256, topk=4, experts=8)
    dc = Deepcomm(ctx, max_tokens=32, ll_tokens=8, backend="reference")
    inp = make_inputs(Workload(32, 256, 4, 8, seed=3), rank, world, ctx.device)
    out = dc.fp8_combine_errors(Case("deepcomm", "normal", "combine", "fp8", 32), inp)
    dc.close()
    return out


def test_fp8_combine_error_is_small_but_not_zero():
    for max_rel, err, ref in run_ranks(_errors_worker, 2):
        # e4m3 keeps 4 significant bits: at most 1/28 of a block's largest element per remote row (two at EP2
        # can't both be remote), and a few percent on average
        assert 0 < max_rel < 1 / 14
        assert ref > 0 and 0 < err / ref < 0.05
