"""Host cost of the differentiable eager calls (deepcomm.ops.dispatch / combine under autograd, what an MoE layer
runs in training) against the Buffer's own calls, and against deepcomm/eager_ops.py as it was at another commit,
in the same process, rounds alternating: `python dev/profile_autograd.py [--rev REV] [--tokens 128]
[--json PATH]`. One rank on one GPU (speed figures mean nothing on a shared GPU); needs git for --rev."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from profile_host import _host_times, setup_calls  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _module_at(rev: str):
    """deepcomm/eager_ops.py as it was at ``rev``, loaded as a module of its own (it imports only torch)."""
    text = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:deepcomm/eager_ops.py"], check=True,
                          capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "eager_ops_at_rev.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("eager_ops_at_rev", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(tokens: int, rev: str, rounds: int, json_path: str) -> None:
    import torch.distributed as dist
    from deepcomm import eager_ops, ops
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    torch.cuda.set_device(0)
    buf, idx, w, x, _, h, y = setup_calls(0, tokens, 7168, 24)
    be = buf._backend
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    yg = y.detach().requires_grad_()
    rw = torch.rand(h.num_recv, 8, device=x.device).requires_grad_()
    g = torch.ones(tokens, 7168, device=x.device, dtype=torch.bfloat16)

    def step():  # forward and backward of dispatch -> combine, what a training step runs per MoE layer
        recv, _, recv_w, _, hh = ops.dispatch(buf, xg, idx, wg, 256)
        out, _ = ops.combine(buf, recv, hh, topk_weights=recv_w)
        out.backward(g)

    cases = {
        "Buffer.dispatch fresh (reference)": (lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=256),
                                              be),
        "Buffer.combine with weights (reference)": (lambda: buf.combine(y, h, topk_weights=rw.detach()), None),
        "ops.dispatch (autograd)": (lambda: ops.dispatch(buf, xg, idx, wg, 256), be),
        "ops.combine (autograd, weights)": (lambda: ops.combine(buf, yg, h, topk_weights=rw), None),
        "dispatch + combine, forward and backward": (step, None),
    }
    versions = {"working tree": eager_ops}
    if rev:
        versions[f"eager_ops.py at {rev}"] = _module_at(rev)
    got = {}
    for _ in range(rounds):
        for label, mod in versions.items():
            ops.eager_ops = mod
            for name, (fn, backend) in cases.items():
                if label != "working tree" and "(reference)" in name:
                    continue
                got.setdefault((label, name), []).append(_host_times(fn, backend)["host_us"])
    ops.eager_ops = eager_ops
    one_launch = torch.zeros(1, device=x.device)
    launch_us = _host_times(lambda: one_launch.add_(1))["host_us"]
    rows = [{"version": label, "call": name, "host_us_rounds": v, "host_us": round(statistics.median(v), 1)}
            for (label, name), v in got.items()]
    print(f"{tokens} tokens, hidden 7168, top-8 of 256, 24 SMs; one torch kernel launch {launch_us} us")
    for r in rows:
        print(f"{r['version']:28s} {r['call']:44s} {r['host_us']:8.1f} us  rounds {r['host_us_rounds']}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"tokens": tokens, "hidden": 7168, "num_sms": 24, "rows": rows, "one_launch_us": launch_us,
                       "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "commit": os.environ.get("DEEPCOMM_COMMIT", "")}, f, indent=1)
    buf.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rev", default="", help="also time deepcomm/eager_ops.py as it was at this git revision")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default="")
    a = p.parse_args()
    main(a.tokens, a.rev, a.rounds, a.json)
