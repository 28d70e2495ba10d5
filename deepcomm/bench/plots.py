"""PNG plots of a run; skipped (returns []) when matplotlib is not importable.

- bandwidth_vs_tokens.png   normal mode, GB/s per (system, op, dtype) at default num_sms
- bandwidth_vs_num_sms.png  deepcomm's num_sms sweep, GB/s per (op, dtype)
- latency_vs_tokens.png     low-latency mode: mean time in us per (system, op, dtype, timing)
"""
from __future__ import annotations

import os
from collections import defaultdict


def _series(results, keep, key, x, y):
    groups = defaultdict(dict)
    for r in results:
        if keep(r) and r.get(y) is not None and r.get(x) is not None:
            groups[key(r)][r[x]] = r[y]
    return {k: sorted(v.items()) for k, v in sorted(groups.items()) if v}


def write_plots(doc: dict, out_dir: str) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # any import problem means: no plots
        return []
    os.makedirs(out_dir, exist_ok=True)
    results = doc["results"]
    title = f"{doc['machine']}, EP{doc['world_size']}, {doc['date']}, commit {doc.get('commit', '?')}"
    sweep_sms = {r["num_sms"] for r in results if r["system"] == "deepcomm" and r["num_sms"] is not None}
    default_rows = [r for r in results if r["system"] != "deepcomm" or len(sweep_sms) <= 1
                    or _is_default(r, results)]
    plans = [
        ("bandwidth_vs_tokens.png", "tokens per rank", "GB/s (logical)", "tokens", "gbps", True,
         _series(default_rows, lambda r: r["mode"] == "normal",
                 lambda r: f"{r['system']} {r['op']} {r['dtype']}", "tokens", "gbps")),
        ("bandwidth_vs_num_sms.png", "num_sms", "GB/s (logical)", "num_sms", "gbps", False,
         _series(results, lambda r: r["system"] == "deepcomm" and r["mode"] == "normal",
                 lambda r: f"{r['op']} {r['dtype']} T={r['tokens']}", "num_sms", "gbps")),
        ("latency_vs_tokens.png", "tokens per rank", "time per call (us)", "tokens", "time_us", True,
         _series(default_rows, lambda r: r["mode"] == "low_latency",
                 lambda r: f"{r['system']} {r['op']} {r['dtype']}" + (" (graph)" if r.get("timing") == "cuda-graph"
                                                                      else ""), "tokens", "time_us")),
    ]
    written = []
    for name, xlabel, ylabel, _, y, logx, series in plans:
        if name == "bandwidth_vs_num_sms.png":   # only token counts that were swept
            series = {k: v for k, v in series.items() if len(v) > 1}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(8, 5))
        for i, (label, pts) in enumerate(series.items()):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^D"[i // 10 % 4],
                    linestyle=["-", "--", ":", "-."][i // 10 % 4], label=label)
        if logx:
            ax.set_xscale("log", base=2)
        if y == "time_us":
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def _is_default(r, results) -> bool:
    """A deepcomm row at its default num_sms: the first row of its (mode, op, dtype, tokens) group."""
    for other in results:
        if other["system"] == "deepcomm" and all(other.get(k) == r.get(k)
                                                 for k in ("mode", "op", "dtype", "tokens", "timing")):
            return other is r
    return False
