"""The torch operators (aten) one call runs on its host path, on a CPU box: on a GPU host each costs microseconds
(a dispatch through torch, often a kernel launch or an allocation), so their number is a GPU-free measure of a
call's host cost. The NVLink backend through its stand-ins (tests/helpers/nvl_stand_ins.py) and the internode
kernels' calls with the ranks as threads (tests/helpers/hier_stand_ins.py), per call kind and per source line,
with the internode calls' NVLink-hop copies and barriers (each a call into the extension on a GPU host):
`python dev/count_host_ops.py [--by-line] [--json PATH]`."""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402


# deepcomm functions that run a kernel's work with torch where the device is a CPU (on a GPU: one launch)
ORACLES = frozenset({"fill_reference"})  # deepcomm/internode/hier_route.py


_counting = threading.local()  # the Counted open in this thread (the ranks run as threads)


def _count_node_calls(cls, names) -> dict:
    """Wraps the NVLink-hop stand-in's methods ``names`` so that each call counts in the Counted open in its thread:
    on a GPU each is a call into the extension (a peer copy, a barrier launch). Returns the originals."""
    originals = {n: getattr(cls, n) for n in names}
    for n, f in originals.items():
        def counted(self, *args, _f=f, _n=n, **kwargs):
            c = getattr(_counting, "current", None)
            if c is not None and (_n != "fence" or self.gpus > 1):
                c.node_calls[_n] += 1
            return _f(self, *args, **kwargs)
        setattr(cls, n, counted)
    return originals


class Counted(TorchDispatchMode):
    """Counts the aten operators deepcomm's code runs inside it, by operator and by the line that ran them; those
    the stand-ins run (tests/helpers: the threads' transport and node areas, whose GPU versions are kernels or
    copies of their own) are counted apart, in ``stand_in``, and so are those of a kernel's torch oracle that runs
    in the kernel's place on a CPU device (ORACLES)."""

    def __init__(self):
        super().__init__()
        self.ops, self.lines, self.stand_in = collections.Counter(), collections.Counter(), 0
        self.node_calls = collections.Counter()  # NVLink-hop copies and barriers (on a GPU: a call each)

    def __enter__(self):
        _counting.current = self
        return super().__enter__()

    def __exit__(self, *exc):
        _counting.current = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frames = [f for f in traceback.extract_stack()
                  if f"{os.sep}deepcomm{os.sep}" in f.filename or f"{os.sep}tests{os.sep}helpers{os.sep}" in f.filename]
        if frames and (f"{os.sep}tests{os.sep}" in frames[-1].filename or any(f.name in ORACLES for f in frames)):
            self.stand_in += 1
        else:
            name = str(func.overloadpacket)
            self.ops[name] += 1
            where = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?"
            self.lines[f"{where} {name}"] += 1
        return func(*args, **(kwargs or {}))


def nvlink_calls() -> dict:
    from tests.helpers.nvl_stand_ins import Patches, cpu_backend
    patches = Patches()
    try:
        b = cpu_backend(patches.setattr).b
        T, H, K, E = 128, 1024, 8, 8
        x, idx, w = torch.zeros(T, H, dtype=torch.bfloat16), torch.zeros(T, K, dtype=torch.int64), torch.zeros(T, K)
        *_, h = b.dispatch(x, idx, w, E, None, 1)
        calls = {"fresh dispatch": lambda: b.dispatch(x, idx, w, E, None, 1),
                 "cached dispatch": lambda: b.dispatch(x, None, w, E, h, 1),
                 "combine": lambda: b.combine(x, h, None)}
        out = {}
        for name, call in calls.items():
            with Counted() as c:
                call()
            out[name] = c
        return out
    finally:
        patches.undo()


def internode_calls(nodes: int, gpus: int) -> dict:
    from deepcomm import agreement
    from deepcomm.internode import hier_kernels as hk
    from deepcomm.internode.internode_rows import max_node_row_bytes
    from tests.helpers.hier_stand_ins import recording_kernels, recording_world
    from tests.helpers.nvl_stand_ins import Patches
    from tests.helpers.threaded_world import World, run
    M, H, K = 64, 256, 8
    R = nodes * gpus
    E = 16 * R
    world = World(R, gpus, area_bytes=R * M * max_node_row_bytes(H), timeout_s=120.0)

    def rank_calls(rank):
        k = recording_kernels(world, rank, [], M, H)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(M, H, generator=gen).to(torch.bfloat16)
        idx = torch.rand(M, E, generator=gen).topk(K, dim=1).indices
        w = torch.rand(M, K, generator=gen)
        words = agreement.dispatch(1, 1, x, idx, w, E, None)
        got = {}
        with Counted() as c:
            h = hk.dispatch(k, x, idx, w, E, None, 1, words)[4]
        got["fresh dispatch"] = c
        y = torch.randn(h.num_recv, H, generator=gen).to(torch.bfloat16)
        yw = torch.rand(h.num_recv, K, generator=gen)
        with Counted() as c:
            hk.dispatch(k, x, None, w, E, h, 1, None)
        got["cached dispatch"] = c
        with Counted() as c:
            hk.combine(k, y, h, yw, False, None)
        got["combine"] = c
        with Counted() as c:
            hk.combine(k, y, h, yw, False, None)
        got["combine again (same handle)"] = c
        return got

    from tests.helpers.hier_stand_ins import RecordedArea
    patches = Patches()
    originals = _count_node_calls(RecordedArea, ("put", "fence"))
    try:
        recording_world(patches.setattr)
        return run(world, rank_calls)[0]
    finally:
        for n, f in originals.items():
            setattr(RecordedArea, n, f)
        patches.undo()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--by-line", action="store_true", help="also list the operators by source line")
    p.add_argument("--json", default="")
    a = p.parse_args()
    report = {"NVLink (world size 1)": nvlink_calls(), "internode 2 x 1": internode_calls(2, 1),
              "internode 2 x 2": internode_calls(2, 2), "internode 2 x 8": internode_calls(2, 8)}
    out = {}
    for path, calls in report.items():
        for name, c in calls.items():
            total = sum(c.ops.values())
            out[f"{path}: {name}"] = {"ops": total, "by_op": dict(c.ops), "stand_in_ops": c.stand_in,
                                      "node_calls": dict(c.node_calls)}
            node = ", ".join(f"{v} node {k}s" for k, v in sorted(c.node_calls.items()))
            print(f"{path + ': ' + name:44s} {total:4d}  " + ", ".join(f"{k.removeprefix('aten.')} {v}"
                                                                      for k, v in c.ops.most_common())
                  + (f"  (+{c.stand_in} in the stand-ins)" if c.stand_in else "") + (f"; {node}" if node else ""))
            if a.by_line:
                for line, n in sorted(c.lines.items()):
                    print(f"{'':8s}{n:3d}  {line}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "calls": out}, f, indent=1)


if __name__ == "__main__":
    main()
