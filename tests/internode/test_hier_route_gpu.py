"""The route kernel of a fresh internode dispatch (csrc/kernels/hier_route.cu) against its torch oracle
(deepcomm/internode/hier_route.py fill_reference), bit for bit, on one GPU: it reads only the ids, so any topology
up to 32 x 8 ranks runs in one process. Token counts below, at and past the kernel's tile (2048) and block
shapes; random, masked, repeated-expert, all-empty and one-expert routings; K from 1 to 32; experts past one
expert block (2048); ids outside [-1, E) anywhere, huge ones too (they must count nowhere and be counted)."""
from __future__ import annotations

import pytest
import torch

from deepcomm import agreement
from deepcomm._ext import load_extension
from deepcomm.internode import hier_route
from tests.helpers.nccl_run import gpu_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")]

TOKENS = (0, 1, 5, 2047, 2048, 2049, 4096, 6001)
# (ranks, gpus per node, experts per rank)
TOPOLOGIES = ((1, 1, 8), (2, 1, 4), (4, 2, 2), (6, 3, 4), (16, 8, 16), (32, 1, 1), (40, 8, 3), (64, 4, 2),
              (128, 8, 2), (256, 8, 1), (256, 1, 9), (8, 8, 512))


def _routing(gen, T, E, K, mode):
    if mode == "empty" or T == 0:
        return torch.full((T, K), -1, dtype=torch.int64)
    if mode == "one":  # every slot names expert 0 or -1
        return torch.where(torch.rand(T, K, generator=gen) < 0.5, 0, -1).to(torch.int64)
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    if mode in ("masked", "bad"):
        idx[torch.rand(T, K, generator=gen) < 0.3] = -1
    if mode == "dup" and K > 1:
        idx[:, K - 1] = idx[:, 0]
    if mode == "bad":  # a few ids outside [-1, E), huge ones among them
        pick = torch.rand(T, K, generator=gen) < 0.01
        pick[0, 0] = True
        vals = torch.tensor([-2, E, E + 1, 1 << 40, -(1 << 50)])[torch.randint(0, 5, (T, K), generator=gen)]
        idx = torch.where(pick, vals, idx)
    return idx.contiguous()


def _same(got, want, what):
    for name in ("in_rank", "send_pos", "rdma_slot", "row"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what} {name}: {a.dtype}{tuple(a.shape)}"
        if not torch.equal(a.cpu(), b):
            bad = (a.cpu() != b).nonzero()[:4].tolist()
            raise AssertionError(f"{what} {name} differs at {bad}")
    (held_got, ones_got), (held_want, ones_want) = hier_route.held_views(got), hier_route.held_views(want)
    views = dict(masks=(got.masks, want.masks), held_slot=(held_got, held_want), one_held=(ones_got, ones_want))
    for name, (a, b) in views.items():
        if b is None:
            assert a is None, f"{what} {name}"
        elif not torch.equal(a.cpu(), b):
            bad = (a.cpu() != b).nonzero()[:4].tolist()
            raise AssertionError(f"{what} {name} differs at {bad}")


def test_route_kernel_equals_the_oracle():
    C = load_extension()
    dev = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(7)
    modes = ("random", "masked", "dup", "empty", "one", "bad")
    case = 0
    for R, G, per_rank in TOPOLOGIES:
        E = R * per_rank
        for T in TOKENS:
            for K in (1, 8, 32):
                K = min(K, E)
                mode = modes[case % len(modes)]
                case += 1
                idx = _routing(gen, T, E, K, mode)
                words = tuple(range(100, 100 + agreement.WORDS)) if case % 2 else None
                got = hier_route.route(C.transport, idx.to(dev), E, R, G, words)
                torch.cuda.synchronize()
                want = hier_route.route(None, idx, E, R, G, words)
                _same(got, want, f"R={R} G={G} E={E} T={T} K={K} {mode} words={words is not None}")


def test_route_kernel_keeps_to_its_workspace():
    """Sentinels around the workspace and in its padding stay as they were (the kernel writes its regions only)."""
    C = load_extension()
    dev = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(3)
    for R, G, E, T in ((12, 4, 48, 333), (2, 1, 8, 2049)):
        idx = _routing(gen, T, E, 4, "masked").to(dev)
        lay = C.hier_route_work(T, R, G, E, True)
        guard = 64
        buf = torch.full((lay["total"] + 2 * guard,), -7, dtype=torch.int32, device=dev)
        work = buf[guard:guard + lay["total"]]
        C.transport.hier_route(idx.data_ptr(), T, 4, E, R, G, tuple([1] * agreement.WORDS), work.data_ptr(),
                               torch.cuda.current_stream(dev).cuda_stream)
        torch.cuda.synchronize()
        assert bool((buf[:guard] == -7).all()) and bool((buf[-guard:] == -7).all()), f"R={R}: wrote outside"
        N = R // G if G > 1 else 0
        gap = buf[guard + lay["one_held"] + N:guard + lay["row"]]  # padding before the row
        assert bool((gap == -7).all()), f"R={R}: wrote into the padding"
