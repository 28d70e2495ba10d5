"""A backend whose low-latency mode serves fewer ranks than the group (Capabilities.max_low_latency_ranks: the
internode backend: deepcomm._C.LL_MAX_RANKS) refuses a low-latency call in Buffer, with a
ValueError on every rank before anything is exchanged, and the Buffer goes on with the next call. On the CPU over
the reference backend, its capability lowered to stand for a group larger than the limit."""
import dataclasses

import torch

from deepcomm.backend_protocol import Capabilities
from deepcomm.nvlink.backend import CudaBackend
from deepcomm.reference.backend import ReferenceBackend
from tests.helpers.multiproc import run_ranks


def test_only_a_backend_that_says_so_limits_its_low_latency_ranks():
    assert {f.name: f for f in dataclasses.fields(Capabilities)}["max_low_latency_ranks"].default == 0
    assert ReferenceBackend.capabilities.max_low_latency_ranks == 0
    assert CudaBackend.capabilities.max_low_latency_ranks == 0  # at most 8 ranks: within any limit


def _worker(rank, world, limit):
    import deepcomm
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=256, num_max_low_latency_tokens=8)
    backend = buf._live()
    backend.capabilities = dataclasses.replace(backend.capabilities, max_low_latency_ranks=limit)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 256, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, 4 * world, (4, 2), generator=gen)
    try:
        buf.low_latency_dispatch(x, idx, 8, 4 * world, use_fp8=False)
        seen = "no error"
    except ValueError as exc:
        seen = str(exc)
    out = buf.dispatch(x, topk_idx=idx, num_experts=4 * world)  # the next call runs on every rank
    sent = sum(len(set((idx[t] // 4).tolist())) for t in range(idx.shape[0]))  # (token, destination rank) pairs
    return seen, int(out[4].num_recv), sent


def test_a_low_latency_call_beyond_the_backends_ranks_raises_on_every_rank():
    for limit, raised in ((1, True), (2, False)):
        got = run_ranks(_worker, 2, limit)
        for seen, _, _ in got:
            if raised:
                assert seen.startswith("group: low-latency mode on the reference backend serves at most 1 ranks, "
                                       "this group has 2"), seen
            else:
                assert seen == "no error"
        assert sum(n for _, n, _ in got) == sum(sent for _, _, sent in got)
