"""Worst-case-size dispatch without host sync, CUDA-graph capture and replay with new data, async finish with
events, and input errors found on the device — all against the reference backend, bit for bit."""
import pytest
import torch

from deepcomm.bench.peers import capture_graph
from tests.helpers.nccl_run import cuda_buffer, needs_ranks, rank_device, ranks_for_tests, reference, run_on_gpus

pytestmark = [pytest.mark.gpu, needs_ranks(2)]

T, H, E, K = 96, 2048, 32, 4


def _inputs(gen, dev):
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    idx[torch.rand(T, K, generator=gen) < 0.2] = -1
    w = torch.rand(T, K, generator=gen)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    return x.to(dev), idx.to(dev), w.to(dev)


def _expert(recv_x):
    return (recv_x.float() * 2 - 1).to(torch.bfloat16)


def _reference_step(ref, x, idx, w):
    recv_x, recv_idx, recv_w, counts, h = ref.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                                       expert_alignment=4)
    comb, comb_w = ref.combine(_expert(recv_x), h, topk_weights=recv_w)
    return recv_x, recv_idx, counts, comb, comb_w


def _assert_padding(recv_idx, recv_w, src_idx, n: int, what: str) -> None:
    """Rows past the ``n`` received ones are padding, as the reference backend pads them (dispatch_rows.py)."""
    assert bool((recv_idx[n:] == -1).all()), f"{what}: padding rows' expert ids are not -1"
    if recv_w is not None:
        assert bool((recv_w[n:] == 0).all()), f"{what}: padding rows' weights are not 0"
    if src_idx is not None:
        assert bool((src_idx[n:] == -1).all()), f"{what}: padding rows' source index is not -1"


def _worker(rank, world):
    dev = rank_device(rank)
    gen = torch.Generator().manual_seed(100 + rank)
    cuda = cuda_buffer(max_tokens_per_rank=T, hidden=H, num_sms=6, timeout_s=20)
    ref = reference(dev, max_tokens_per_rank=T, hidden=H)
    W = world * T

    # 1. worst-case size, eager
    x, idx, w = _inputs(gen, dev)
    recv_x, recv_idx, recv_w, counts, h = cuda.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                                        expert_alignment=4, num_worst_tokens=W)
    want = _reference_step(ref, x, idx, w)
    n = want[0].shape[0]
    assert recv_x.shape == (W, H) and h.num_recv == W
    assert torch.equal(recv_x[:n], want[0]) and torch.equal(recv_idx[:n], want[1])
    _assert_padding(recv_idx, recv_w, h.recv_src_idx, n, "eager")
    assert counts.tolist() == want[2]
    comb, comb_w = cuda.combine(_expert(recv_x), h, topk_weights=recv_w)
    assert torch.equal(comb, want[3]) and torch.equal(comb_w, want[4])

    # 2. CUDA graph: capture dispatch + expert + combine once, replay with new inputs
    xs, idxs, ws = (t.clone() for t in _inputs(gen, dev))

    def step():
        rx, ri, rw, cnt, hh = cuda.dispatch(xs, topk_idx=idxs, topk_weights=ws, num_experts=E,
                                            expert_alignment=4, num_worst_tokens=W)
        c, cw = cuda.combine(_expert(rx), hh, topk_weights=rw)
        return rx, ri, cnt, c, cw

    graph, static_out = capture_graph(step)
    for replay in range(3):
        x, idx, w = _inputs(gen, dev)
        xs.copy_(x), idxs.copy_(idx), ws.copy_(w)
        graph.replay()
        torch.cuda.synchronize()
        want = _reference_step(ref, x, idx, w)
        n = want[0].shape[0]
        rx, ri, cnt, c, cw = static_out
        assert torch.equal(rx[:n], want[0]), f"replay {replay}: recv_x"
        assert torch.equal(ri[:n], want[1]), f"replay {replay}: recv_topk_idx"
        _assert_padding(ri, None, None, n, f"replay {replay}")
        assert cnt.tolist() == want[2], f"replay {replay}: counts"
        assert torch.equal(c, want[3]) and torch.equal(cw, want[4]), f"replay {replay}: combine"
    cuda.synchronize()

    # 3. previous_event in, async finish, event out
    x, idx, w = _inputs(gen, dev)
    ready = torch.cuda.Event()
    ready.record()
    recv_x, recv_idx, recv_w, counts, h = cuda.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E,
                                                        expert_alignment=4, previous_event=ready,
                                                        async_finish=True)
    torch.cuda.current_stream().wait_event(cuda.event)
    want = _reference_step(ref, x, idx, w)
    assert torch.equal(recv_x, want[0]) and counts == want[2]
    comb, comb_w = cuda.combine(_expert(recv_x), h, topk_weights=recv_w, async_finish=True)
    torch.cuda.current_stream().wait_event(cuda.event)
    assert torch.equal(comb, want[3]) and torch.equal(comb_w, want[4])

    # 4. bad expert ids with no host sync: every rank stops the call and raises at its next check
    bad = idx.clone()
    if rank == 0:
        bad[0, 0] = E + 3
    cuda.dispatch(x, topk_idx=bad, num_experts=E, num_worst_tokens=W)
    with pytest.raises(ValueError, match="topk_idx"):
        cuda.synchronize()
    # 5. a worst case smaller than what arrives: rows are dropped, never written out of bounds, and reported
    cuda.dispatch(x, topk_idx=idx, num_experts=E, num_worst_tokens=1)
    with pytest.raises(ValueError, match="num_worst_tokens"):
        cuda.synchronize()
    # 6. the same inside a replayed graph, where the combine runs with no host check in between: the dropped rows
    # are neither sent back nor waited for, so the replay completes and the overflow is what is reported
    def small_step():
        rx, _, rw, _, hh = cuda.dispatch(xs, topk_idx=idxs, topk_weights=ws, num_experts=E, num_worst_tokens=1)
        return cuda.combine(_expert(rx), hh, topk_weights=rw)

    small_graph = torch.cuda.CUDAGraph()  # no eager warm-up: that would report the overflow before the capture
    with torch.cuda.graph(small_graph):
        small_step()
    small_graph.replay()
    with pytest.raises(ValueError, match="num_worst_tokens"):
        cuda.synchronize()
    del small_graph
    # 7. bad ids in a replay of the step-2 graph (dispatch + combine, no host check in between): the dispatch
    # clears its route, so the combine moves nothing and the replay completes; the ids are what is reported
    bad = idxs.clone()
    if rank == 0:
        bad[0, 0] = E + 3
    idxs.copy_(bad)
    graph.replay()
    with pytest.raises(ValueError, match="topk_idx"):
        cuda.synchronize()
    # the buffer is still usable after all of these
    out = cuda.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=4)
    assert torch.equal(out[0], _reference_step(ref, x, idx, w)[0])
    cuda.synchronize()
    del static_out, graph
    cuda.destroy()
    ref.destroy()


def test_worst_case_graph_and_async():
    run_on_gpus(_worker, ranks_for_tests())
