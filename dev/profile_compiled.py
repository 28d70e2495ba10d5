"""Host cost of deepcomm.ops inside torch.compile graphs: a dispatch + combine step compiled with inductor, against
the same step eager, at world size 1 with L local experts (L = 32 is an EP8 rank's share of 256 experts): its
forward under no_grad (inference), and forward and backward with autograd (a training step: the backward is a
cached dispatch and a combine). Each compiled step runs twice:
with the operator outputs of this tree, and as before them ("copies": the routing tensors copied, the counts made
by torch.tensor, and the combine given a counts tensor rebuilt from the symbolic ints), each checked bit for bit
against eager. A diagnostic, not the benchmark: `python dev/profile_compiled.py [--experts 32,256] [--json PATH]`.
One rank per GPU (speed figures mean nothing on a shared GPU); the timer and the profile are dev/profile_host.py's."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # the repository, for tests.helpers
from tests.helpers.nccl_run import run_on_gpus  # noqa: E402
from profile_host import _cprofile, _host_times  # noqa: E402  (this folder, the script's own)

class _AsBefore:
    """The operator outputs as they were made before OwnedViews and Handle.per_expert_tensor: patched in for the
    compile (handle_args) and the runs (the operator's own Python)."""

    def __init__(self):
        from deepcomm import custom_ops, ops
        self.c, self.ops, self.saved = custom_ops, ops, None

    def __enter__(self):
        c, ops = self.c, self.ops
        self.saved = (c.workspace_outputs, c._host_counts, ops.handle_args)
        real_handle_args = ops.handle_args

        def handle_args(handle):
            args = list(real_handle_args(handle))
            if not args[-1]:  # not the worst-case form: the counts rebuilt from the (symbolic) ints
                args[4] = torch.tensor(handle.num_recv_tokens_per_expert, dtype=torch.int32)
            return tuple(args)
        c.workspace_outputs = lambda *a: None
        c._host_counts = lambda per_expert: torch.tensor(per_expert, dtype=torch.int32)
        ops.handle_args = handle_args
        return self

    def __exit__(self, *exc):
        self.c.workspace_outputs, self.c._host_counts, self.ops.handle_args = self.saved


def worker(rank, world, tokens, hidden, num_sms, experts_list, json_path, cprofile_path=""):
    import deepcomm
    from deepcomm import ops
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    torch._dynamo.config.capture_scalar_outputs = True
    dev = torch.device("cuda", rank)
    rows = []
    for E in experts_list:
        buf = deepcomm.Buffer(max_tokens_per_rank=tokens, hidden=hidden, backend="cuda", num_sms=num_sms)
        g = torch.Generator(device=dev).manual_seed(E)
        idx = torch.rand(tokens, E, device=dev, generator=g).topk(8, dim=1).indices
        w = torch.rand(tokens, 8, device=dev, generator=g)
        x = torch.randn(tokens, hidden, device=dev, generator=g).to(torch.bfloat16)

        def step(x, idx, w):
            recv_x, _, recv_w, _, handle = ops.dispatch(buf, x, idx, w, num_experts=E)
            out, combined_w = ops.combine(buf, recv_x, handle, topk_weights=recv_w)
            return out, combined_w

        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()

        def train(fn):
            """The step with autograd, then its backward (a cached dispatch and a combine): (out, x.grad, w.grad)."""
            def run():
                xg.grad = wg.grad = None
                out, combined_w = fn(xg, idx, wg)
                (out.float().sum() + combined_w.sum()).backward()
                return out.detach(), xg.grad, wg.grad
            return run

        for kind in ("forward, no grad", "forward and backward"):
            grad = kind == "forward and backward"
            with torch.set_grad_enabled(grad):
                run = train(step) if grad else (lambda: step(x, idx, w))
                want = [t.clone() for t in run()]
                t = _host_times(run)
                rows.append({"experts": E, "local_experts": E // world, "step": kind, "path": "eager",
                             "host_us": t["host_us"], "wall_us": t["wall_us"]})
                for variant in ("copies", "this tree"):
                    torch._dynamo.reset()
                    compiled = torch.compile(step, fullgraph=True, backend="inductor")
                    crun = train(compiled) if grad else (lambda: compiled(x, idx, w))
                    t0 = time.perf_counter()
                    with (_AsBefore() if variant == "copies" else contextlib.nullcontext()):
                        got = crun()
                        same = all(torch.equal(a, b) for a, b in zip(want, got))
                        t = _host_times(crun)
                    rows.append({"experts": E, "local_experts": E // world, "step": kind,
                                 "path": f"compiled, {variant}", "host_us": t["host_us"], "wall_us": t["wall_us"],
                                 "bit_exact": same, "first_call_s": round(time.perf_counter() - t0, 1)})
                    if cprofile_path and variant == "this tree" and rank == 0:
                        _cprofile({f"compiled {kind}, {E} experts": (crun, None)}, cprofile_path, tokens, 300)
                if cprofile_path and rank == 0:
                    _cprofile({f"eager {kind}, {E} experts": (run, None)}, cprofile_path, tokens, 300)
        dist.barrier()
        buf.destroy()
    if rank == 0:
        print(f"{'experts':>7s} {'step':22s} {'path':24s} {'host':>8s} {'wall':>8s}   (us per step)")
        for r in rows:
            print(f"{r['experts']:7d} {r['step']:22s} {r['path']:24s} {r['host_us']:8.1f} {r['wall_us']:8.1f} "
                  f"{'' if r.get('bit_exact', True) else 'NOT BIT-EXACT'}")
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"world_size": world, "tokens": tokens, "hidden": hidden, "num_sms": num_sms,
                           "torch": torch.__version__, "rows": rows,
                           "device": torch.cuda.get_device_name(dev),
                           "commit": os.environ.get("DEEPCOMM_COMMIT", "")}, f, indent=1)
    if not all(r.get("bit_exact", True) for r in rows):
        raise SystemExit("a compiled step differs from eager")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--num-sms", type=int, default=24)
    p.add_argument("--experts", default="32,256")
    p.add_argument("--json", default="")
    p.add_argument("--cprofile", default="", help="also write the steps' cProfile (eager, compiled) here")
    a = p.parse_args()
    run_on_gpus(worker, 1, a.tokens, a.hidden, a.num_sms, [int(e) for e in a.experts.split(",")], a.json, a.cprofile,
                timeout_s=600)
