"""torch.compile(fullgraph=True) through deepcomm's operators, in 2 CPU processes (reference backend, gloo).

Compiled results (forward and backward) must equal eager bit for bit: dispatch + combine (aot_eager and inductor:
the arithmetic around them is exact), the MoE layer (aot_eager: the same aten ops as eager, after dynamo, AOT
autograd and functionalization traced them), the num_worst_tokens form and the low-latency calls (static: traced
without the data-dependent settings). dynamo.explain must count one graph and no breaks (dispatch + combine, and
the MoE layer's forward). Checks that need the data (alignment, expert-id values) raise ValueError at run time
from inside the compiled graph. Worst-case per-expert counts, eager and compiled, equal the host's count.
"""
import pytest
import torch

from tests.helpers import bruteforce as bf
from tests.helpers.multiproc import run_ranks

HIDDEN, SLOTS, PER_RANK, WORLD = 16, 3, 2, 2


def _data_dependent_settings(on: bool) -> None:
    # a fresh dispatch's row count (an unbacked size) and per-expert counts (unbacked ints): docs/api.md
    torch._dynamo.config.capture_dynamic_output_shape_ops = on
    torch._dynamo.config.capture_scalar_outputs = on


def _inputs(rank, dtype=torch.float32):
    gen = torch.Generator().manual_seed(11 + rank)
    tokens = [5, 8][rank]
    idx = bf.make_topk(gen, tokens, SLOTS, PER_RANK * WORLD, p_empty=0.3)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    w = torch.rand(tokens, SLOTS, generator=gen)
    return x, idx, w


def _dispatch_combine(buf):
    import deepcomm

    def step(x, idx, w):
        recv_x, recv_idx, recv_w, counts, handle = deepcomm.ops.dispatch(buf, x, idx, w, num_experts=PER_RANK * WORLD)
        out, combined_w = deepcomm.ops.combine(buf, recv_x * 3.0, handle, topk_weights=recv_w * 2.0)
        return out, combined_w, recv_x, recv_idx, handle.recv_src_idx, handle.count_matrix
    return step


def _run(step, x, idx, w):
    """Outputs of ``step`` and the gradients of x and w for a fixed upstream gradient."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    outs = step(x, idx, w)
    g = torch.Generator().manual_seed(5)
    loss = (outs[0] * torch.randn(outs[0].shape, generator=g)).sum() + (outs[1] * torch.rand(outs[1].shape, generator=g)).sum()
    loss.backward()
    return [o.detach() for o in outs] + [x.grad, w.grad]


def _same(want, got, what):
    assert len(want) == len(got)
    for i, (a, b) in enumerate(zip(want, got)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}[{i}]: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
        assert torch.equal(a, b), f"{what}[{i}] differs"


def _dispatch_combine_worker(rank, world, backend):
    import deepcomm
    _data_dependent_settings(True)
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=HIDDEN)
    step = _dispatch_combine(buf)
    x, idx, w = _inputs(rank)
    want = _run(step, x, idx, w)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    _same(want, _run(compiled, x, idx, w), f"{backend} rank {rank}")
    # new routing, new token count: the same compiled code (sizes are symbolic), still equal
    x2, idx2, w2 = _inputs(1 - rank)
    _same(_run(step, x2, idx2, w2), _run(compiled, x2, idx2, w2), f"{backend} rank {rank}, second inputs")
    # Dynamo must never reach the operators' implementations (Python that reads data and talks to peers), which
    # are registered without torch.compiler.disable: compiled without fullgraph, forward and backward twice,
    # dynamo sees one frame, the step's own.
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    again = torch.compile(step, backend=backend)
    for _ in range(2):
        _same(want, _run(again, x, idx, w), f"{backend} rank {rank}, without fullgraph")
    assert dict(counters["frames"]) == {"total": 1, "ok": 1}, dict(counters["frames"])
    buf.destroy()
    return True


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_dispatch_combine_matches_eager(backend):
    assert run_ranks(_dispatch_combine_worker, WORLD, backend, timeout=600) == [True] * WORLD


def _explain_worker(rank, world):
    import deepcomm
    _data_dependent_settings(True)
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=HIDDEN)
    x, idx, w = _inputs(rank)
    explained = torch._dynamo.explain(_dispatch_combine(buf))(x, idx, w)
    ops = [str(n.target).split(".")[:2] for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    # and the MoE layer's forward (router, fused dispatch, grouped experts, combine)
    from deepcomm.moe import MoELayer
    torch.manual_seed(3)
    layer = MoELayer(buf, HIDDEN, 24, PER_RANK * world, 2, expert_alignment=4, dtype=torch.float32)
    moe = torch._dynamo.explain(layer)(x.clone().requires_grad_())
    buf.destroy()
    return explained.graph_count, explained.graph_break_count, ops.count(["deepcomm", "dispatch"]), \
        ops.count(["deepcomm", "combine"]), moe.graph_count, moe.graph_break_count


def test_explain_counts_no_graph_breaks():
    assert run_ranks(_explain_worker, WORLD) == [(1, 0, 1, 1, 1, 0)] * WORLD


def _moe_worker(rank, world, alignment):
    import deepcomm
    from deepcomm.moe import MoELayer
    _data_dependent_settings(True)
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=HIDDEN)
    torch.manual_seed(3)  # the same parameters on both ranks' layers (the router is replicated)
    layer = MoELayer(buf, HIDDEN, 24, PER_RANK * world, 2, expert_alignment=alignment, dtype=torch.float32)
    x = torch.randn([6, 9][rank], HIDDEN, generator=torch.Generator().manual_seed(rank))

    def run(fn):
        layer.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        y = fn(leaf)
        (y * y).sum().backward()
        return [y.detach(), leaf.grad] + [p.grad.clone() for p in layer.parameters()], \
            list(layer.last_tokens_per_expert)

    want, want_counts = run(layer)
    got, got_counts = run(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    _same(want, got, f"MoE layer, rank {rank}, alignment {alignment}")
    assert got_counts == want_counts and all(c % alignment == 0 for c in got_counts)
    buf.destroy()
    return True


@pytest.mark.parametrize("alignment", [1, 4])
def test_compiled_moe_layer_matches_eager(alignment):
    assert run_ranks(_moe_worker, WORLD, alignment, timeout=600) == [True] * WORLD


def _worst_case_worker(rank, world):
    import deepcomm
    _data_dependent_settings(False)  # static shapes: no data-dependent setting needed
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=HIDDEN)
    worst = 20

    def step(x, idx, w):
        recv_x, _, recv_w, counts, handle = deepcomm.ops.dispatch(buf, x, idx, w, num_experts=PER_RANK * world,
                                                                  num_worst_tokens=worst)
        out, combined_w = deepcomm.ops.combine(buf, recv_x * 3.0, handle, topk_weights=recv_w)
        return out, combined_w, recv_x, counts, handle.recv_src_idx

    x, idx, w = _inputs(rank)
    want = _run(step, x, idx, w)
    got = _run(torch.compile(step, fullgraph=True, backend="aot_eager"), x, idx, w)
    _same(want, got, f"num_worst_tokens, rank {rank}")
    assert got[2].shape == (worst, HIDDEN)
    buf.destroy()
    return True


def test_compiled_worst_case_form_is_static():
    assert run_ranks(_worst_case_worker, WORLD) == [True] * WORLD


def _low_latency_worker(rank, world):
    import deepcomm
    _data_dependent_settings(False)
    hidden, M, E = 128, 8, PER_RANK * world
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=hidden, num_max_low_latency_tokens=M)
    gen = torch.Generator().manual_seed(21 + rank)
    T = [3, 6][rank]
    x = torch.randn(T, hidden, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(T)])
    idx[0, 1] = -1
    w = torch.rand(T, 2, generator=gen)

    def step(x, idx, w, use_fp8):
        recv_x, recv_count, handle = deepcomm.ops.low_latency_dispatch(buf, x, idx, M, E, use_fp8=use_fp8)
        values = deepcomm.fp8.per_token_cast_back(*recv_x).to(torch.bfloat16) if use_fp8 else recv_x
        out = deepcomm.ops.low_latency_combine(buf, values * 2.0, idx, w, handle)
        return out, recv_count, handle.src_info, handle.layout, handle.recv_pos

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for use_fp8 in (False, True):
        want = [t.clone() for t in step(x, idx, w, use_fp8)]
        _same(want, [t.clone() for t in compiled(x, idx, w, use_fp8)], f"low latency fp8={use_fp8}, rank {rank}")
    buf.destroy()
    return True


def test_compiled_low_latency_matches_eager():
    assert run_ranks(_low_latency_worker, WORLD) == [True] * WORLD


def _validation_worker(rank, world):
    import deepcomm
    _data_dependent_settings(True)
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=HIDDEN)
    compiled = torch.compile(_dispatch_combine(buf), fullgraph=True, backend="aot_eager")
    x, idx, w = _inputs(rank)
    errors = []
    # a view 4 bytes into a larger tensor: misaligned rows, only visible in the data pointer
    wide = torch.cat([x.new_zeros(1), x.reshape(-1)])
    bad_idx = idx.clone()
    bad_idx[1, 0] = PER_RANK * world  # on every rank: each one rejects its own input
    for bad, want in (((wide[1:].view(x.shape), idx, w), "x: data must start on a 16-byte boundary"),
                      ((x, bad_idx, w), "topk_idx: expert ids must be <")):
        with pytest.raises(ValueError) as caught:
            compiled(*bad)
        assert str(caught.value).startswith(want), str(caught.value)
        errors.append(want)
    # and the Buffer still works afterwards
    _same(_run(_dispatch_combine(buf), x, idx, w), _run(compiled, x, idx, w), f"after errors, rank {rank}")
    buf.destroy()
    return errors


def test_data_checks_raise_inside_compiled_graph():
    results = run_ranks(_validation_worker, WORLD, timeout=300)
    assert all(len(r) == 2 for r in results)


def _worst_counts_worker(rank, world):
    import deepcomm
    from tests.helpers import worst_counts
    buf = deepcomm.Buffer(max_tokens_per_rank=16, hidden=HIDDEN)
    gen = torch.Generator().manual_seed(31 + rank)
    T = 5 + 3 * rank
    idx = bf.make_topk(gen, T, SLOTS, PER_RANK * world, p_empty=0.3)
    x, w = torch.randn(T, HIDDEN, generator=gen), torch.rand(T, SLOTS, generator=gen)
    _data_dependent_settings(True)  # the worst-case form traces either way; the fresh calls need them
    rows = worst_counts.run_steps(rank, world, buf, x, idx, w, PER_RANK * world, world * 16)
    worst_counts.normal_calls(buf, x, idx, w, PER_RANK * world)
    rows += worst_counts.run_steps(rank, world, buf, x, idx, w, PER_RANK * world, world * 16, "after fresh calls: ")
    buf.destroy()
    return rows


@pytest.mark.parametrize("world", [2, 4])
def test_worst_case_counts_match_host_counts(world):
    """Every worst-case dispatch's per-expert counts, eager and compiled, in any order, equal the host's count."""
    from tests.helpers import worst_counts
    rows = [r for per_rank in run_ranks(_worst_counts_worker, world, timeout=600) for r in per_rank]
    assert len(rows) == 2 * world * len(worst_counts.STEPS)
    assert not worst_counts.failures(rows), "\n".join(worst_counts.failures(rows))
