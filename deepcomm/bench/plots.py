"""PNG plots of a run, one figure per mode (and one for deepcomm's num_sms sweep); skipped (returns []) when
matplotlib is not importable.

- ``<mode>_bandwidth_vs_tokens.png``  normal and internode modes: logical GB/s per (system, op, dtype), deepcomm at
  its default num_sms
- ``normal_bandwidth_vs_num_sms.png``   deepcomm's num_sms sweep: GB/s per (op, dtype, tokens)
- ``low_latency_time_vs_tokens.png``    low-latency mode: median µs per call per (system, op, dtype, timing)

deepcomm is drawn with thick solid lines, its peers with thin dashed or dotted ones; one colour per (op, dtype),
one marker per system, hollow markers for eager timing beside filled CUDA-graph ones, so every series differs;
legends sit outside the axes. A mode measured at a
single token count is drawn as bars. ``python -m deepcomm.bench.plots --out DIR RESULT.json`` redraws a result file.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

# Colours for (op, dtype): matplotlib's tab20 colours, strong shades first.
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7",
           "#dbdb8d", "#9edae5"]
OWN_STYLE = {"linestyle": "-", "linewidth": 2.8, "marker": "o", "markersize": 6}
PEER_STYLES = [{"linestyle": "--", "linewidth": 1.4, "marker": "s", "markersize": 5},
               {"linestyle": ":", "linewidth": 1.6, "marker": "^", "markersize": 5},
               {"linestyle": "-.", "linewidth": 1.4, "marker": "D", "markersize": 4},
               {"linestyle": (0, (5, 1, 1, 1, 1, 1)), "linewidth": 1.4, "marker": "v", "markersize": 5}]
MODE_NAMES = {"normal": "normal mode", "low_latency": "low-latency mode",
              "internode-emulated": "internode (emulated NIC)", "internode-nvshmem": "internode (NVSHMEM device puts)",
              "internode-nvshmem-host": "internode (NVSHMEM host API)",
              "internode-reference": "internode (reference backend)"}


@dataclass
class Series:
    label: str
    points: List[Tuple[float, float]]
    style: Dict[str, object]


@dataclass
class Figure:
    name: str
    title: str
    subtitle: str
    xlabel: str
    ylabel: str
    series: List[Series] = field(default_factory=list)
    logx: bool = True
    logy: bool = False

    @property
    def single_x(self) -> bool:
        return len({x for s in self.series for x, _ in s.points}) <= 1


def _subtitle(doc: dict) -> str:
    text = f"{doc.get('machine', '?')}, EP{doc.get('world_size', '?')}, {doc.get('date', '?')}, " \
           f"commit {doc.get('commit', '?')}"
    if doc.get("backend") == "reference":
        text += "\nreference backend: these times measure the pure-PyTorch oracle, not the CUDA kernels"
    return text


def _is_default(r: dict, results: List[dict]) -> bool:
    """A deepcomm row at its default num_sms: the first row of its (mode, op, dtype, tokens, timing) group."""
    for other in results:
        if other["system"] == "deepcomm" and all(other.get(k) == r.get(k)
                                                 for k in ("mode", "op", "dtype", "tokens", "timing")):
            return other is r
    return False


def _styled(groups: Dict[tuple, Dict[float, float]], label_of) -> List[Series]:
    """One Series per group key ``(system, op, dtype[, more])``: line style and marker by system, colour by (op,
    dtype); a key's fourth part, the timing, draws "eager" with hollow markers (cuda-graph and others filled)."""
    systems = sorted({k[0] for k in groups}, key=lambda s: (s != "deepcomm", s))
    colours: Dict[tuple, str] = {}
    out = []
    for key in sorted(groups, key=lambda k: (systems.index(k[0]), [str(p) for p in k[1:]])):
        colour = colours.setdefault(key[1:3], PALETTE[len(colours) % len(PALETTE)])
        base = OWN_STYLE if key[0] == "deepcomm" else PEER_STYLES[(systems.index(key[0]) - 1) % len(PEER_STYLES)]
        style = dict(base, color=colour)
        if len(key) > 3 and key[3] == "eager":
            style.update(markerfacecolor="white", markeredgewidth=1.6)
        out.append(Series(label_of(key), sorted(groups[key].items()), style))
    return out


def _group(rows: List[dict], key, x: str, y: str) -> Dict[tuple, Dict[float, float]]:
    groups: Dict[tuple, Dict[float, float]] = defaultdict(dict)
    for r in rows:
        if r.get(x) is not None and r.get(y) is not None:
            groups[key(r)][r[x]] = r[y]
    return groups


def figures(doc: dict) -> List[Figure]:
    """What ``write_plots`` draws, as data (testable without matplotlib)."""
    results = doc["results"]
    sub = _subtitle(doc)
    out = []
    for mode in sorted({r["mode"] for r in results}, key=lambda m: (list(MODE_NAMES).index(m)
                                                                    if m in MODE_NAMES else 99, m)):
        rows = [r for r in results if r["mode"] == mode and (r["system"] != "deepcomm" or _is_default(r, results))]
        name = MODE_NAMES.get(mode, mode)
        if mode == "low_latency":
            timed = "median_us" if any(r.get("median_us") is not None for r in rows) else "time_us"
            groups = _group(rows, lambda r: (r["system"], r["op"], r["dtype"], r.get("timing") or "eager"),
                            "tokens", timed)
            fig = Figure("low_latency_time_vs_tokens.png", f"{name}: time per call vs tokens per rank", sub,
                         "tokens per rank", "median time per call (µs, log scale)",
                         _styled(groups, lambda k: f"{k[0]} {k[1]} {k[2]} ({k[3]})"), logy=True)
        else:
            groups = _group(rows, lambda r: (r["system"], r["op"], r["dtype"]), "tokens", "gbps")
            fig = Figure(f"{mode}_bandwidth_vs_tokens.png", f"{name}: logical bandwidth vs tokens per rank", sub,
                         "tokens per rank", "GB/s (logical, slowest rank)",
                         _styled(groups, lambda k: f"{k[0]} {k[1]} {k[2]}"))
        if fig.series:
            out.append(fig)
    sweep = _group([r for r in results if r["system"] == "deepcomm" and r["mode"] == "normal"],
                   lambda r: ("deepcomm", r["op"], r["dtype"], r["tokens"]), "num_sms", "gbps")
    sweep = {k: v for k, v in sweep.items() if len(v) > 1}
    if sweep:
        out.append(Figure("normal_bandwidth_vs_num_sms.png", "normal mode: deepcomm's logical bandwidth vs num_sms",
                          sub, "num_sms (SMs given to the communication kernels)", "GB/s (logical, slowest rank)",
                          _styled(sweep, lambda k: f"deepcomm {k[1]} {k[2]}, {k[3]} tokens"), logx=False))
    return out


def _draw(plt, fig_spec: Figure, path: str) -> None:
    fig, ax = plt.subplots(figsize=(10, 5.2))
    if fig_spec.single_x:  # one token count: bars, one per series
        labels = [s.label for s in fig_spec.series]
        values = [s.points[0][1] for s in fig_spec.series]
        bars = ax.barh(range(len(labels)), values, color=[s.style["color"] for s in fig_spec.series])
        for bar, s in zip(bars, fig_spec.series):
            if s.style.get("linestyle") == OWN_STYLE["linestyle"]:
                bar.set_edgecolor("black")
                bar.set_linewidth(1.8)
            else:
                bar.set_hatch("//")
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel(fig_spec.ylabel)
        x = fig_spec.series[0].points[0][0]
        title = fig_spec.title.replace(" vs tokens per rank", f" at {x:g} tokens per rank")
        ax.set_title(f"{title}\n{fig_spec.subtitle}", fontsize=10)
        if fig_spec.logy:
            ax.set_xscale("log")
        ax.grid(True, axis="x", alpha=0.3)
    else:
        for s in fig_spec.series:
            ax.plot([p[0] for p in s.points], [p[1] for p in s.points], label=s.label, **s.style)
        if fig_spec.logx:
            ax.set_xscale("log", base=2)
            ticks = sorted({p[0] for s in fig_spec.series for p in s.points})
            ax.set_xticks(ticks)
            ax.set_xticklabels([f"{t:g}" for t in ticks])
        if fig_spec.logy:
            ax.set_yscale("log")
        ax.set_xlabel(fig_spec.xlabel)
        ax.set_ylabel(fig_spec.ylabel)
        ax.set_title(f"{fig_spec.title}\n{fig_spec.subtitle}", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(doc: dict, out_dir: str, modes: Optional[List[str]] = None) -> List[str]:
    """Draw ``figures(doc)`` (only those of ``modes`` when given; the num_sms sweep counts as "normal") into
    ``out_dir``; returns the paths written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # any import problem means: no plots
        return []
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for spec in figures(doc):
        if modes is not None and not any(spec.name.startswith(m + "_") for m in modes):
            continue
        path = os.path.join(out_dir, spec.name)
        _draw(plt, spec, path)
        written.append(path)
    return written


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deepcomm.bench.plots", description="Redraw a result file's plots.")
    p.add_argument("result", help="a result file written by --json")
    p.add_argument("--out", required=True, help="directory for the PNG files")
    p.add_argument("--modes", default=None, help="comma-separated modes to draw (default: every mode in the file)")
    args = p.parse_args(argv)
    with open(args.result) as f:
        doc = json.load(f)
    written = write_plots(doc, args.out, args.modes.split(",") if args.modes else None)
    print("wrote " + ", ".join(written) if written else "nothing written (matplotlib missing, or no such mode)")
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
