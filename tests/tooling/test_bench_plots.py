"""The benchmark's plots and header: one figure per mode with mode and metric in the title, deepcomm drawn apart
from its peers, every series distinct; a reference-backend run says its timings are the oracle's."""
import io
import os

import pytest

from deepcomm.bench import plots, report


def _row(system, mode, op, dtype, tokens, y, num_sms=None, timing="eager"):
    return {"system": system, "mode": mode, "op": op, "dtype": dtype, "tokens": tokens, "num_sms": num_sms,
            "timing": timing, "time_us": y, "median_us": y, "gbps": 1000.0 / y if "+" not in op else None}


def _doc(backend="cuda"):
    rows = []
    for t in (128, 512, 4096):
        for op, dt in (("dispatch", "fp8"), ("dispatch", "bf16"), ("combine", "bf16"), ("combine", "fp8")):
            rows.append(_row("deepcomm", "normal", op, dt, t, 10.0 + t / 100, num_sms=24))
            rows.append(_row("nccl-a2a", "normal", op, dt, t, 9.0 + t / 100))
        rows.append(_row("nccl-moe-layer", "normal", "dispatch", "bf16", t, 50.0 + t / 100))
    rows += [_row("deepcomm", "normal", "dispatch", "fp8", 4096, 60.0 - n, num_sms=n) for n in (8, 16, 32)]
    for t in (1, 32, 128):
        for timing in ("eager", "cuda-graph"):
            for op in ("dispatch", "combine", "dispatch+combine"):
                rows.append(_row("deepcomm", "low_latency", op, "fp8", t, 15.0 + t / 10, timing=timing))
        rows.append(_row("nccl-a2a", "low_latency", "dispatch", "fp8", t, 70.0))
    rows.append(_row("deepcomm", "internode-emulated", "dispatch", "bf16", 4096, 3000.0, num_sms=24))
    return {"machine": "2x GPU", "date": "2026-12-01", "commit": "abc1234", "world_size": 2, "backend": backend,
            "results": rows}


def test_one_figure_per_mode_with_mode_and_metric_in_the_title():
    figs = {f.name: f for f in plots.figures(_doc())}
    assert set(figs) == {"normal_bandwidth_vs_tokens.png", "normal_bandwidth_vs_num_sms.png",
                         "low_latency_time_vs_tokens.png", "internode-emulated_bandwidth_vs_tokens.png"}
    assert figs["normal_bandwidth_vs_tokens.png"].title.startswith("normal mode: logical bandwidth")
    assert figs["low_latency_time_vs_tokens.png"].title.startswith("low-latency mode: time per call")
    assert figs["internode-emulated_bandwidth_vs_tokens.png"].single_x
    ll = figs["low_latency_time_vs_tokens.png"]
    assert {x for s in ll.series for x, _ in s.points} == {1, 32, 128}  # over the token sweep
    assert "commit abc1234" in ll.subtitle and "oracle" not in ll.subtitle
    # the num_sms sweep: deepcomm's swept rows only, default-num_sms rows not duplicated in the token plot
    (sweep,) = figs["normal_bandwidth_vs_num_sms.png"].series
    assert [x for x, _ in sweep.points] == [8, 16, 24, 32]
    dc = [s for s in figs["normal_bandwidth_vs_tokens.png"].series if s.label == "deepcomm dispatch fp8"]
    assert [x for x, _ in dc[0].points] == [128, 512, 4096]


def test_deepcomm_drawn_apart_and_every_series_distinct():
    for fig in plots.figures(_doc()):
        looks = [(s.style["color"], str(s.style["linestyle"]), s.style["marker"], s.style.get("markerfacecolor"))
                 for s in fig.series]
        assert len(set(looks)) == len(looks), fig.name
        for s in fig.series:
            if s.label.startswith("deepcomm"):
                assert s.style["linestyle"] == "-" and s.style["linewidth"] >= 2.5, s.label
            else:
                assert s.style["linestyle"] != "-" and s.style["linewidth"] < 2.0, s.label


def test_reference_runs_say_the_timings_are_the_oracles(tmp_path):
    doc = report.make_document(_doc("reference")["results"], "cpu", 2, "reference")
    assert "oracle" in doc["caveat"] and "not the CUDA kernels" in doc["caveat"]
    out = io.StringIO()
    report.print_report(doc, out)
    assert out.getvalue().splitlines()[1].startswith("caveat: deepcomm ran on its reference backend")
    path = tmp_path / "r.json"
    report.write_json(doc, str(path))
    assert '"caveat"' in path.read_text()
    assert "caveat" not in report.make_document([], "cpu", 2, "cuda")
    assert all("oracle" in f.subtitle for f in plots.figures(doc))


def test_write_plots_draws_the_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    written = plots.write_plots(_doc(), str(tmp_path), modes=["low_latency", "internode-emulated"])
    assert sorted(os.path.basename(p) for p in written) == ["internode-emulated_bandwidth_vs_tokens.png",
                                                             "low_latency_time_vs_tokens.png"]
    assert all(os.path.getsize(p) > 10_000 for p in written)
