"""Output: stdout table, JSON (the result format of docs/benchmarks/README.md), CSV, progress bar."""
from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys

# Keys of one result, in the documented order (docs/benchmarks/README.md); `host_us`: median host time per call
# (entry to return, on the calling thread).
RESULT_KEYS = ["system", "mode", "op", "dtype", "tokens", "hidden", "topk", "experts", "num_sms",
               "time_us", "median_us", "host_us", "gbps", "timing"]
# The header of a run whose deepcomm rows come from the reference backend (every CPU run).
REFERENCE_NOTE = ("deepcomm ran on its reference backend: its timings measure the pure-PyTorch oracle "
                  "(torch.distributed collectives), not the CUDA kernels, and say nothing of deepcomm's speed")
# Written only on the results that have them: the FP8 combine's error against the BF16 combine (metrics.py).
ERROR_KEYS = ["max_rel_err", "mean_rel_err"]


def _run(cmd: list[str], cwd: str | None = None) -> str:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_commit() -> str:
    """Short hash of the checkout; DEEPCOMM_COMMIT names it where the tree travelled without .git."""
    if os.environ.get("DEEPCOMM_COMMIT"):
        return os.environ["DEEPCOMM_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    return _run(["git", "rev-parse", "--short", "HEAD"], cwd=here) or "unknown"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return re.sub(r"\s+", " ", line.split(":", 1)[1]).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def nvlink_label() -> str:
    """'NV18' style label from `nvidia-smi topo -m` (the widest NVLink bond seen), '' if unknown."""
    links = [int(n) for n in re.findall(r"\bNV(\d+)\b", _run(["nvidia-smi", "topo", "-m"]))]
    return f"NV{max(links)}" if links else ""


def machine_description(device_type: str, world_size: int) -> str:
    if device_type == "cuda":
        import torch

        name = torch.cuda.get_device_name(0)
        label = nvlink_label()
        return f"{world_size}x {name}" + (f" ({label})" if label else "")
    return f"{cpu_model()} x {world_size} processes"


def make_document(results: list[dict], device_type: str, world_size: int, backend: str | None) -> dict:
    doc = {"machine": machine_description(device_type, world_size),
           "date": _dt.date.today().isoformat(),
           "commit": git_commit(),
           "world_size": world_size}
    if backend:
        doc["backend"] = backend    # which deepcomm backend ran (cuda | reference)
    if backend == "reference":
        doc["caveat"] = REFERENCE_NOTE
    doc["results"] = [{**{k: r.get(k) for k in RESULT_KEYS}, **{k: r[k] for k in ERROR_KEYS if k in r}}
                      for r in results]
    return doc


def write_json(doc: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    head = {k: v for k, v in doc.items() if k != "results"}
    lines = [json.dumps(r) for r in doc["results"]]
    text = json.dumps(head)[:-1] + ',\n "results": [\n  ' + ",\n  ".join(lines) + "\n ]}\n"
    json.loads(text)  # one result per line, still one JSON object
    with open(path, "w") as f:
        f.write(text)


def write_csv(results: list[dict], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RESULT_KEYS + ERROR_KEYS, extrasaction="ignore", restval="")
        w.writeheader()
        w.writerows(results)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) < 10:
            return f"{v:.2f}"
        return f"{v:.1f}" if abs(v) < 1e6 else f"{v:.3g}"
    return str(v)


def format_table(results: list[dict]) -> str:
    cols = [("system", "system"), ("mode", "mode"), ("op", "op"), ("dtype", "dtype"), ("tokens", "tokens"),
            ("num_sms", "sms"), ("timing", "timing"), ("time_us", "mean us"), ("median_us", "median us"),
            ("host_us", "host us"), ("gbps", "GB/s")]
    if any(k in r for r in results for k in ERROR_KEYS):
        cols += [("max_rel_err", "max rel err"), ("mean_rel_err", "mean rel err")]
    rows = [[(f"{r[k]:.2e}" if k in ERROR_KEYS and r.get(k) is not None else _fmt(r.get(k))) for k, _ in cols]
            for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, (_, h) in enumerate(cols)]
    numeric = {"tokens", "num_sms", "time_us", "median_us", "host_us", "gbps", *ERROR_KEYS}

    def line(cells):
        return "  ".join(c.rjust(w) if cols[i][0] in numeric else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    out = [line([h for _, h in cols]), line(["-" * w for w in widths])]
    out += [line(row) for row in rows]
    return "\n".join(out)


def print_report(doc: dict, stream=None) -> None:
    stream = stream or sys.stdout
    head = f"deepcomm bench | {doc['machine']} | world_size {doc['world_size']} | commit {doc['commit']}"
    if doc.get("backend"):
        head += f" | deepcomm backend {doc['backend']}"
    print(head, file=stream)
    if doc.get("caveat"):
        print(f"caveat: {doc['caveat']}", file=stream)
    print(format_table(doc["results"]), file=stream)
    if doc.get("hook_overlap"):
        o = doc["hook_overlap"]
        print(f"hook overlap ({o['matmul']} between a {o['tokens']}-token {o['dtype']} low-latency send and its "
              f"hook): {o['compute_alone_us']:.1f} us alone, {o['compute_with_send_pending_us']:.1f} us with the "
              f"send pending" + (f" (median ratio {o['pending_over_alone_median']:.3f} over {o['pairs']} "
                                 f"alternating pairs)" if "pairs" in o else ""), file=stream)
    stream.flush()


class Progress:
    """A one-line progress bar on stderr (a line per step when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool = True, width: int = 28, stream=None):
        self.total, self.done, self.width = max(total, 1), 0, width
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def step(self, label: str) -> None:
        if not self.enabled:
            return
        self.done += 1
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        text = f"[{bar}] {self.done}/{self.total} {label}"
        if self.tty:
            self.stream.write("\r\033[K" + text)
            if self.done >= self.total:
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
