"""Low-latency kernels against the reference backend, bit for bit: 1..256 tokens, -1 slots, all tokens to one
expert, hidden 384/2048/2176/5120/7168, BF16/FP8/UE8M0, hook mode, two micro-batches in flight (also interleaved with a
combine), bad ids found on the device (a flood of duplicates included), hooks on another stream, CUDA-graph replay;
the optional FP8 combine against the reference's FP8 math."""
import pytest
import torch

from deepcomm.bench.peers import capture_graph
from tests.helpers.nccl_run import cuda_buffer, needs_ranks, rank_device, ranks_for_tests, reference, run_on_gpus

pytestmark = [pytest.mark.gpu, needs_ranks(2)]

M = 256


def ll_buffer(backend, **options):
    """A Buffer of the low-latency GPU tests' shape (normal mode up to 256 tokens of hidden 7168, low-latency mode
    up to M tokens) on ``backend``; a CUDA one gives up a wait after 20 s, its ``num_sms`` within this rank's share
    of the GPU; a reference one answers in tensors on the current CUDA device (nccl_run.reference). Set DEEPCOMM_*
    variables before."""
    sizes = dict(max_tokens_per_rank=256, hidden=7168, num_max_low_latency_tokens=M)
    if backend == "reference":
        return reference(torch.device("cuda", torch.cuda.current_device()), **sizes, **options)
    options.setdefault("timeout_s", 20)
    return cuda_buffer(**sizes, **options)


def _routing(gen, T, E, K, mode, dev):
    if mode == "one_expert":
        idx = torch.full((T, K), -1, dtype=torch.int64)
        idx[:, 0] = 0
    else:
        idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
        if mode == "masked":
            idx[torch.rand(T, K, generator=gen) < 0.3] = -1
    return idx.to(dev), torch.rand(T, K, generator=gen).to(dev)


def _bytes(t):
    return t.contiguous().view(torch.uint8)


def _check_dispatch(got, want, what):
    (gx, gcount, gh, _), (wx, wcount, wh, _) = got, want
    assert torch.equal(gcount, wcount), f"{what}: recv_count"
    assert torch.equal(gh.layout, wh.layout), f"{what}: layout"
    assert torch.equal(gh.src_info, wh.src_info), f"{what}: src_info"
    assert torch.equal(gh.recv_pos, wh.recv_pos), f"{what}: recv_pos"
    gparts = gx if isinstance(gx, tuple) else (gx,)
    wparts = wx if isinstance(wx, tuple) else (wx,)
    for e, n in enumerate(wcount.tolist()):
        for i, (g, w) in enumerate(zip(gparts, wparts)):
            assert torch.equal(_bytes(g[e, :n]), _bytes(w[e, :n])), f"{what}: recv_x part {i} expert {e}"


def check_cases(cuda, ref, cases, gen, dev, world):
    """Dispatch and combine of each (T, H, E, K, routing mode, dtype) case on ``cuda``, bit for bit against ``ref``."""
    for T, H, E, K, mode, dtype in cases:
        what = f"T={T} H={H} E={E} K={K} {mode} {dtype}"
        idx, w = _routing(gen, T, E, K, mode, dev)
        x = (torch.randn(T, H, generator=gen) * 2).to(torch.bfloat16).to(dev)
        kw = dict(use_fp8=dtype != "bf16", use_ue8m0=dtype == "ue8m0")
        got = cuda.low_latency_dispatch(x, idx, M, E, **kw)
        want = ref.low_latency_dispatch(x, idx, M, E, **kw)
        _check_dispatch(got, want, what)
        y = torch.randn(E // world, world * M, H, generator=gen).to(torch.bfloat16).to(dev)
        out, _ = cuda.low_latency_combine(y, idx, w, got[2])
        ref_out, _ = ref.low_latency_combine(y, idx, w, want[2])
        assert torch.equal(out, ref_out), f"{what}: combine"
        out8, _ = cuda.low_latency_combine(y, idx, w, got[2], use_fp8=True)
        assert torch.equal(out8, ref.low_latency_combine(y, idx, w, want[2], use_fp8=True)[0]), f"{what}: fp8 combine"



def check_graph_replay(cuda, ref, gen, dev, world, T, E, K, H, label):
    """Dispatch + combine (bf16) captured once in a CUDA graph, replayed 3 times with new inputs copied into the
    captured tensors; every replay's outputs against the reference."""
    xs = torch.zeros(T, H, dtype=torch.bfloat16, device=dev)
    idxs, ws = _routing(gen, T, E, K, "random", dev)
    ys = torch.zeros(E // world, world * M, H, dtype=torch.bfloat16, device=dev)

    def step():
        rx, cnt, h, _ = cuda.low_latency_dispatch(xs, idxs, M, E, use_fp8=False)
        o, _ = cuda.low_latency_combine(ys, idxs, ws, h)
        return rx, cnt, h, o

    graph, static = capture_graph(step)
    for replay in range(3):
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
        idx, w = _routing(gen, T, E, K, "masked", dev)
        y = torch.randn(E // world, world * M, H, generator=gen).to(torch.bfloat16).to(dev)
        xs.copy_(x), idxs.copy_(idx), ws.copy_(w), ys.copy_(y)
        graph.replay()
        torch.cuda.synchronize(dev)
        want = ref.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        _check_dispatch(static[:3] + (None,), want, f"{label} {replay}")
        assert torch.equal(static[3], ref.low_latency_combine(y, idx, w, want[2])[0]), f"{label} {replay}"
    torch.cuda.synchronize(dev)

def _worker(rank, world):
    dev = rank_device(rank)
    gen = torch.Generator().manual_seed(300 + rank)
    cuda, ref = ll_buffer("cuda", num_sms=16), ll_buffer("reference")
    cases = [(1, 7168, 256, 8, "random", "bf16"), (7, 2048, 64, 4, "masked", "fp8"),
             (128, 7168, 256, 8, "random", "fp8"), (256, 5120, 32, 6, "masked", "ue8m0"),
             (128, 7168, 256, 8, "one_expert", "bf16"), (0 if rank == 0 else 5, 2048, 64, 4, "random", "fp8"),
             # rows that end in a partial 1024-element chunk, or fit in less than one
             (5, 384, 64, 4, "random", "fp8"), (33, 2176, 32, 6, "masked", "bf16"), (17, 2176, 32, 6, "random", "ue8m0")]
    check_cases(cuda, ref, cases, gen, dev, world)
    # hook mode, with two micro-batches in flight (both slots) before either is received
    T, H, E, K = 128, 7168, 256, 8
    batches = []
    for _ in range(2):
        idx, w = _routing(gen, T, E, K, "masked", dev)
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
        batches.append((x, idx, w, cuda.low_latency_dispatch(x, idx, M, E, use_fp8=True, return_recv_hook=True)))
    a = torch.randn(2048, 2048, device=dev)
    (a @ a).sum().item()  # compute while nothing is held by communication
    for x, idx, w, got in batches:
        got[3]()
        _check_dispatch(got, ref.low_latency_dispatch(x, idx, M, E, use_fp8=True), "hook")
    x, idx, w, got = batches[1]
    want = ref.low_latency_dispatch(x, idx, M, E, use_fp8=True)
    y = torch.randn(E // world, world * M, H, generator=gen).to(torch.bfloat16).to(dev)
    out, hook = cuda.low_latency_combine(y, idx, w, got[2], return_recv_hook=True)
    hook()
    assert torch.equal(out, ref.low_latency_combine(y, idx, w, want[2])[0]), "hook combine"

    # two micro-batches interleaved as in decoding: batch 2's dispatch is received after batch 1's combine was sent
    x1 = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
    idx1, w1 = _routing(gen, T, E, K, "masked", dev)
    x2 = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
    idx2, _ = _routing(gen, T, E, K, "random", dev)
    d1 = cuda.low_latency_dispatch(x1, idx1, M, E, use_fp8=False)
    want1 = ref.low_latency_dispatch(x1, idx1, M, E, use_fp8=False)
    d2 = cuda.low_latency_dispatch(x2, idx2, M, E, use_fp8=True, return_recv_hook=True)
    y1 = torch.randn(E // world, world * M, H, generator=gen).to(torch.bfloat16).to(dev)
    out1, hook1 = cuda.low_latency_combine(y1, idx1, w1, d1[2], return_recv_hook=True)
    d2[3]()
    hook1()
    _check_dispatch(d2, ref.low_latency_dispatch(x2, idx2, M, E, use_fp8=True), "interleaved dispatch")
    assert torch.equal(out1, ref.low_latency_combine(y1, idx1, w1, want1[2])[0]), "interleaved combine"

    # expert ids are checked on the device: the call completes everywhere, the next look raises, the Buffer lives on
    for fault in ("out_of_range", "duplicate"):
        idx, _ = _routing(gen, 16, 64, 4, "random", dev)
        idx[3, 1] = 64 + rank if fault == "out_of_range" else idx[3, 0]
        cuda.low_latency_dispatch(torch.randn(16, 2048, device=dev).to(torch.bfloat16), idx, M, 64, use_fp8=False)
        with pytest.raises(ValueError, match="topk_idx"):
            cuda.synchronize()
        idx, w = _routing(gen, 16, 64, 4, "random", dev)
        x = torch.randn(16, 2048, generator=gen).to(torch.bfloat16).to(dev)
        _check_dispatch(cuda.low_latency_dispatch(x, idx, M, 64, use_fp8=False),
                        ref.low_latency_dispatch(x, idx, M, 64, use_fp8=False), f"after {fault}")

    # bad ids on rank 0 only: every rank is told in the same call and raises, naming rank 0
    idx, _ = _routing(gen, 16, 64, 4, "random", dev)
    if rank == 0:
        idx[5, 2] = idx[5, 0]
    cuda.low_latency_dispatch(torch.randn(16, 2048, device=dev).to(torch.bfloat16), idx, M, 64, use_fp8=False)
    with pytest.raises(ValueError, match="on rank 0 had a token naming the same expert twice"):
        cuda.synchronize()

    # every slot of every token naming one expert: far more entries than its R * M rows; reported as duplicates,
    # nothing is written out of bounds, and the next call is right
    flood = torch.zeros(T, K, dtype=torch.int64, device=dev)
    _, cnt, fh, _ = cuda.low_latency_dispatch(torch.randn(T, H, device=dev).to(torch.bfloat16), flood, M, E,
                                              use_fp8=True)
    with pytest.raises(ValueError, match="topk_idx"):
        cuda.synchronize()
    # Each rank sends T * K = 1024 entries to expert 0 (rank 0's), which has world * M rows, given out by source
    # rank, lowest first: rank s's entries take rows [s * T * K, ...) and those past the end are dropped (recv_pos
    # -1). With 2 ranks rank 0's own first 512 are kept; with 8 all of ranks 0 and 1. No other expert's rows were
    # touched.
    rows, TK = world * M, T * K
    if rank == 0:
        kept = [max(0, min(TK, rows - s * TK)) for s in range(world)]
        assert int(cnt[0]) == rows and int(cnt[1:].sum()) == 0
        want_src = torch.cat([torch.arange(k, device=dev, dtype=torch.int32) // K for k in kept])
        assert torch.equal(fh.src_info[0], want_src)
        assert bool((fh.src_info[1:] == -1).all())
    else:
        assert int(cnt.sum()) == 0 and bool((fh.src_info == -1).all())
    pos = fh.recv_pos.flatten()
    at_owner = torch.arange(TK, device=dev, dtype=pos.dtype) + rank * TK
    assert torch.equal(pos, torch.where(at_owner < rows, at_owner, torch.full_like(at_owner, -1)))
    idx, w = _routing(gen, T, E, K, "random", dev)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
    _check_dispatch(cuda.low_latency_dispatch(x, idx, M, E, use_fp8=True),
                    ref.low_latency_dispatch(x, idx, M, E, use_fp8=True), "after the duplicate flood")

    # hooks called on another stream, with the combine's inputs dropped by the caller before the hook
    side = torch.cuda.Stream(dev)
    idx, w = _routing(gen, T, E, K, "masked", dev)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
    want = ref.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    got = cuda.low_latency_dispatch(x, idx, M, E, use_fp8=False, return_recv_hook=True)
    with torch.cuda.stream(side):
        got[3]()
    side.synchronize()
    _check_dispatch(got, want, "hook on another stream")
    y = torch.randn(E // world, world * M, H, generator=gen).to(torch.bfloat16).to(dev)
    ref_out = ref.low_latency_combine(y, idx, w, want[2])[0]
    out, hook = cuda.low_latency_combine(y, idx, w, got[2], return_recv_hook=True)
    del y
    torch.randn(E // world, world * M, H, device=dev).to(torch.bfloat16)  # reuses freed blocks if it could
    with torch.cuda.stream(side):
        hook()
    side.synchronize()
    assert torch.equal(out, ref_out), "combine hook on another stream"

    # CUDA graph: dispatch + combine captured once, replayed with new inputs
    check_graph_replay(cuda, ref, gen, dev, world, T, E, K, H, "graph replay")  # the graph is freed on return
    cuda.synchronize()
    cuda.destroy()
    ref.destroy()


def test_low_latency_matches_reference():
    run_on_gpus(_worker, ranks_for_tests())


def _check_under_settings(rank, world, seed, settings, cases, more=None):
    """``check_cases`` against the reference on a fresh CUDA Buffer under each environment in ``settings`` (dicts of
    variables, set in this worker process before the Buffer is made); then, when given,
    ``more(cuda, ref, gen, dev, world, label)``."""
    import os

    dev = rank_device(rank)
    gen = torch.Generator().manual_seed(seed + rank)
    ref = ll_buffer("reference")
    for env in settings:
        os.environ.update(env)
        cuda = ll_buffer("cuda")
        check_cases(cuda, ref, cases, gen, dev, world)
        if more is not None:
            more(cuda, ref, gen, dev, world, " ".join(f"{k}={v}" for k, v in env.items()))
        cuda.synchronize()
        cuda.destroy()
    ref.destroy()


def _few_blocks_worker(rank, world):
    """One block runs both send roles itself (rows, then metadata); two blocks split them. Both against the
    reference, as with one block per SM; plain launches (no programmatic dependent launch)."""
    cases = [(1, 2048, 64, 4, "random", "bf16"), (128, 7168, 256, 8, "masked", "fp8"),
             (0 if rank == 1 else 9, 5120, 32, 6, "one_expert", "ue8m0")]
    _check_under_settings(rank, world, 700, [{"DEEPCOMM_LL_PDL": "0", "DEEPCOMM_LL_NUM_SMS": blocks}
                                             for blocks in ("1", "2")], cases)


def test_low_latency_few_blocks_match_reference():
    run_on_gpus(_few_blocks_worker, ranks_for_tests())


def _back_to_back_and_graph(cuda, ref, gen, dev, world, label):
    """Four dispatches queued back to back (no other kernel between them, so with programmatic dependent launch a
    kernel's blocks start while the one before runs), each slot used twice, the last two checked; then a graph
    replay."""
    T, H, E, K = 128, 7168, 256, 8
    inputs = [(torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev), _routing(gen, T, E, K, "random", dev)[0])
              for _ in range(4)]
    gots = [cuda.low_latency_dispatch(x, idx, M, E, use_fp8=True) for x, idx in inputs]
    for (x, idx), got in zip(inputs[2:], gots[2:]):
        _check_dispatch(got, ref.low_latency_dispatch(x, idx, M, E, use_fp8=True), f"{label}: back to back")
    check_graph_replay(cuda, ref, gen, dev, world, T, E, K, H, f"graph replay, {label}")


def _pdl_worker(rank, world):
    """The kernels launched with programmatic dependent launch, early trigger (1) and without it (2): the same cases,
    back-to-back calls of one kind and a graph replay, against the reference."""
    cases = [(1, 2048, 64, 4, "random", "bf16"), (128, 7168, 256, 8, "masked", "fp8"),
             (0 if rank == 1 else 9, 5120, 32, 6, "one_expert", "ue8m0"), (256, 2176, 32, 6, "random", "fp8")]
    _check_under_settings(rank, world, 900, [{"DEEPCOMM_LL_PDL": mode} for mode in ("1", "2")], cases,
                          more=_back_to_back_and_graph)


def test_low_latency_pdl_matches_reference():
    run_on_gpus(_pdl_worker, ranks_for_tests())
