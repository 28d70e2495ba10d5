"""deepcomm.compat.deep_ep: DeepEP V1's package, signatures, handle tuples and results, from DeepEP's documented
behaviour.

Signatures are compared with DeepEP V1's own source (../shared/peers/deepep-v1 at 567632d, parsed with ast) when
that folder exists. Functional tests run in 1, 2 and 3 CPU processes on the reference backend, each result checked
against a brute-force loop (tests/helpers/bruteforce.py) or the same call of deepcomm.Buffer.
"""
import ast
import inspect
import os
import re
import sys

import pytest
import torch
import torch.distributed as dist

from tests.helpers import bruteforce as bf
from tests.helpers.multiproc import run_ranks
from tests.helpers.paths import ROOT

HIDDEN, PER_RANK = 512, 4
SLOTS = 3
PEER = os.path.join(ROOT, "..", "shared", "peers", "deepep-v1")
PEER = os.environ.get("DEEPEP_V1_SOURCE", PEER if os.path.isdir(PEER) else "/work/shared/peers/deepep-v1")


def _equal(a, b, what):
    assert (a is None) == (b is None), what
    if a is None:
        return
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(a.contiguous().flatten().view(torch.uint8), b.contiguous().flatten().view(torch.uint8)), \
        f"{what}: values differ"


def _inputs(rank, world, tokens):
    gen = torch.Generator().manual_seed(11 + rank)
    idx = bf.make_topk(gen, tokens, SLOTS, PER_RANK * world, p_empty=0.25)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    w = torch.rand(tokens, SLOTS, generator=gen)
    return x, idx, w


def _tokens(world):
    return [25, 0, 17][:world] if world > 1 else [25]


# ---- the package -----------------------------------------------------------------------------------------------
def test_package_layout_after_install():
    import deepcomm.compat as compat
    saved = {k: sys.modules.get(k) for k in compat.MODULES}
    try:
        for k in compat.MODULES:
            sys.modules.pop(k, None)
        assert compat.install_deep_ep() is compat.deep_ep
        import deep_ep
        import deep_ep.buffer
        import deep_ep.utils
        import deep_ep_cpp
        from deep_ep import Buffer, Config, EventOverlap, topk_idx_t
        from deep_ep.buffer import Buffer as B2
        from deep_ep.utils import EventHandle, EventOverlap as E2, check_nvlink_connections
        assert Buffer is B2 and EventOverlap is E2 and topk_idx_t is torch.int64
        assert deep_ep_cpp.Config is Config and deep_ep_cpp.EventHandle is EventHandle
        assert callable(check_nvlink_connections) and callable(deep_ep_cpp.get_low_latency_rdma_size_hint)
        check_nvlink_connections(None)  # no GPU: nothing to check
        # names the shim does not have fail loudly, naming them
        with pytest.raises(ImportError, match="NoSuchThing"):
            from deep_ep import NoSuchThing  # noqa: F401
        # DeepEP's runtime class is there (deep_ep.Buffer.runtime is one); deepcomm makes it inside deep_ep.Buffer
        with pytest.raises(RuntimeError, match="deep_ep.Buffer"):
            deep_ep_cpp.Buffer(0, 1, 0, 0, False, False, False, False)
        with pytest.raises(AttributeError, match="nothing_there"):
            deep_ep_cpp.nothing_there
        with pytest.raises(AttributeError, match="nothing_here"):
            deep_ep.nothing_here
    finally:
        for k, m in saved.items():
            if m is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = m


def test_installed_top_level_package(tmp_path):
    import subprocess
    from deepcomm.compat import install
    path = install.install(str(tmp_path))
    assert install.is_ours(path)
    code = ("import deep_ep, deep_ep.utils, deep_ep.buffer; from deep_ep import Buffer, Config, topk_idx_t; "
            "import deepcomm.compat.deep_ep as d; assert deep_ep is d and deep_ep.utils is d.utils; print('ok')")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(tmp_path)]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
    assert install.remove(str(tmp_path)) and not os.path.exists(path)
    os.makedirs(path)
    open(os.path.join(path, "__init__.py"), "w").write("# a real DeepEP\n")
    with pytest.raises(FileExistsError):
        install.install(str(tmp_path))
    assert not install.remove(str(tmp_path)) and os.path.exists(path)


# ---- signatures against DeepEP's source -------------------------------------------------------------------------
NO_DEFAULT = object()


def _peer_functions(path, cls=None):
    tree = ast.parse(open(path).read())
    nodes = tree.body
    if cls is not None:
        nodes = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return {n.name: n for n in nodes if isinstance(n, ast.FunctionDef)}


def _peer_params(fn):
    """[(name, default source or None)] of the positional parameters, and whether it is a staticmethod."""
    args = fn.args.posonlyargs + fn.args.args
    defaults = [NO_DEFAULT] * (len(args) - len(fn.args.defaults)) + [ast.unparse(d) for d in fn.args.defaults]
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    return [(a.arg, d) for a, d in zip(args, defaults)], static


def _our_params(fn):
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [(p.name, NO_DEFAULT if p.default is p.empty else p.default) for p in params]


def _same_default(ours, theirs_src):
    if theirs_src is NO_DEFAULT or ours is NO_DEFAULT:
        return ours is theirs_src
    return ours == ast.literal_eval(theirs_src)


@pytest.mark.skipif(not os.path.isdir(PEER), reason="DeepEP V1's source is not here")
@pytest.mark.parametrize("module,cls", [("buffer.py", "Buffer"), ("utils.py", "EventOverlap"), ("utils.py", None)])
def test_signatures_match_deep_ep_source(module, cls):
    from deepcomm.compat import deep_ep
    ours_ns = {"buffer.py": deep_ep.buffer, "utils.py": deep_ep.utils}[module]
    ours_owner = getattr(ours_ns, cls) if cls else ours_ns
    for name, fn in _peer_functions(os.path.join(PEER, "deep_ep", module), cls).items():
        if name.startswith("__") and name not in ("__init__", "__enter__", "__exit__"):
            continue
        assert hasattr(ours_owner, name), f"{cls or module}.{name} is missing"
        theirs, static = _peer_params(fn)
        ours_fn = getattr(ours_owner, name)
        if cls is not None:
            assert isinstance(inspect.getattr_static(ours_owner, name), staticmethod) == static, name
        ours = _our_params(ours_fn)
        if cls is not None and not static:
            theirs, ours = theirs[1:], ours[1:]  # self
        assert [n for n, _ in ours] == [n for n, _ in theirs], f"{name}: {ours} vs {theirs}"
        for (n, d_ours), (_, d_theirs) in zip(ours, theirs):
            assert _same_default(d_ours, d_theirs), f"{name}({n}): default {d_ours!r} vs {d_theirs}"
    if cls == "Buffer":  # class attributes with their defaults (num_sms = 20)
        tree = ast.parse(open(os.path.join(PEER, "deep_ep", module)).read())
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
        attrs = {n.target.id: ast.literal_eval(n.value) for n in body if isinstance(n, ast.AnnAssign)}
        assert attrs and all(getattr(ours_owner, k) == val for k, val in attrs.items()), attrs


@pytest.mark.skipif(not os.path.isdir(PEER), reason="DeepEP V1's source is not here")
def test_config_and_module_names_match_deep_ep_source():
    from deepcomm.compat import deep_ep
    src = open(os.path.join(PEER, "csrc", "deep_ep.cpp")).read()
    block = src[src.index('class_<deep_ep::Config>'):src.index('class_<deep_ep::EventHandle>')]
    theirs = [(n, int(d)) for n, d in re.findall(r'py::arg\("(\w+)"\) = (\d+)', block)]
    assert [(n, d) for n, d in _our_params(deep_ep.Config.__init__)[1:]] == theirs
    for method in re.findall(r'^\s+\.def\("(\w+)"', block, re.M):
        assert callable(getattr(deep_ep.Config, method))
    module = src[src.index("PYBIND11_MODULE"):]
    for fn in re.findall(r'm\.def\("(\w+)"', module):
        assert callable(getattr(deep_ep._cpp, fn)), fn
    init = open(os.path.join(PEER, "deep_ep", "__init__.py")).read()
    for name in re.findall(r"import (.+)$", init, re.M):
        for n in name.split(","):
            n = n.strip()
            if n != "torch":
                assert hasattr(deep_ep, n), n


def test_size_hints_and_configs():
    from deepcomm.compat import deep_ep
    B = deep_ep.Buffer
    cfg = B.get_dispatch_config(8)
    assert isinstance(cfg, deep_ep.Config) and cfg.num_sms == B.num_sms
    assert (cfg.num_max_nvl_chunked_send_tokens, cfg.num_max_nvl_chunked_recv_tokens) == (6, 256)
    assert B.get_combine_config(2).num_max_nvl_chunked_send_tokens == 10
    assert isinstance(B.get_dispatch_config(1), deep_ep.Config)   # any rank count, one included
    # DeepEP rounds the RDMA receive chunk up to a multiple of the send chunk
    assert deep_ep.Config(20, 6, 256, 20, 128).num_max_rdma_chunked_recv_tokens == 140
    with pytest.raises(ValueError, match="^num_max_nvl_chunked_send_tokens"):
        deep_ep.Config(20, 256, 256)
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 16) > 0
    nvl = cfg.get_nvl_buffer_size_hint(7168 * 2, 8)
    assert nvl % 128 == 0 and nvl > 10 * 8 * 256 * 7168 * 2
    ll = B.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    # DeepEP's layout: 2 x (send + receive + signalling) buffers, bf16 rows with a 16-byte header
    assert ll % 128 == 0 and ll >= 2 * 2 * 256 * 128 * (7168 * 2 + 16)
    with pytest.raises(ValueError, match="^new_num_sms"):
        B.set_num_sms(7)
    with deep_ep.EventOverlap(deep_ep.EventHandle()) as ev:  # CPU: an already-reached event
        ev.current_stream_wait()
    with pytest.raises(RuntimeError):
        deep_ep.EventOverlap().current_stream_wait()


def test_unsupported_constructor_values_are_refused():
    # checked before any collective, so no process group is needed
    from deepcomm.compat import deep_ep
    with pytest.raises(ValueError, match="^use_fabric"):
        deep_ep.Buffer(None, use_fabric=True)
    with pytest.raises(ValueError, match="^allow_nvlink_for_low_latency_mode"):
        deep_ep.Buffer(None, allow_nvlink_for_low_latency_mode=False)
    with pytest.raises(ValueError, match="group"):
        deep_ep.Buffer(None)


# ---- normal mode -----------------------------------------------------------------------------------------------
def _expected_handle(rank, world, all_idx, num_channels):
    """DeepEP's intranode handle items from a brute-force route."""
    E = PER_RANK * world
    layouts = [bf.layout(idx, E, world) for idx in all_idx]
    counts = torch.stack([lay[0] for lay in layouts])                      # [s, d]
    rank_prefix = counts.cumsum(0).to(torch.int32)
    in_rank, send_pos = layouts[rank][2], layouts[rank][3]
    T = in_rank.shape[0]
    per = -(-T // num_channels) if T else 0
    channel_prefix = torch.zeros(world, num_channels, dtype=torch.int32)
    send_head = torch.full((T, world), -1, dtype=torch.int32)
    for d in range(world):
        for c in range(num_channels):
            tokens = [t for t in range(min(c * per, T), min((c + 1) * per, T)) if in_rank[t, d]]
            for i, t in enumerate(tokens):
                send_head[t, d] = i
            channel_prefix[d, c] = len(tokens) + (channel_prefix[d, c - 1] if c else 0)
    recv_src_idx = [t for s in range(world) for t in range(all_idx[s].shape[0])
                    if rank in bf.ranks_of(all_idx[s][t], E, world)]
    return rank_prefix, channel_prefix, torch.tensor(recv_src_idx, dtype=torch.int32), in_rank, send_head


def _normal_worker(rank, world):
    from deepcomm.compat import deep_ep
    from deepcomm.fp8 import per_token_cast_to_fp8
    E = PER_RANK * world
    buf = deep_ep.Buffer(dist.group.WORLD, int(1e9), 0, max_tokens_per_rank=32, hidden=HIDDEN,
                         backend="reference")
    assert (buf.rank, buf.group_size, buf.num_nvl_bytes, buf.enable_shrink) == (rank, world, int(1e9), False)
    dc = buf.runtime
    all_inputs = [_inputs(r, world, _tokens(world)[r]) for r in range(world)]
    x, idx, w = all_inputs[rank]

    layout = buf.get_dispatch_layout(idx, E)
    assert len(layout) == 5 and layout[1] is None and isinstance(layout[4], deep_ep.EventOverlap)
    per_rank, _, per_expert, in_rank, event = layout
    for got, want, name in zip((per_rank, per_expert, in_rank), dc.get_dispatch_layout(idx, E),
                               ("per_rank", "per_expert", "in_rank")):
        _equal(got, want, name)
    with event:
        pass

    # fresh dispatch with top-k: DeepEP's 6-tuple and handle tuple
    config = deep_ep.Config(4)  # 2 channels
    out = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       topk_idx=idx, topk_weights=w, expert_alignment=2, config=config, async_finish=True)
    assert len(out) == 6
    recv_x, recv_idx, recv_w, counts, handle, event = out
    event.current_stream_wait()
    want = dc.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=2)
    for got_t, want_t, name in zip((recv_x, recv_idx, recv_w), want[:3], ("recv_x", "recv_idx", "recv_w")):
        _equal(got_t, want_t, name)
    assert isinstance(counts, list) and counts == want[3]
    assert isinstance(handle, tuple) and len(handle) == 6
    rank_prefix, channel_prefix, recv_src_idx, want_in_rank, send_head = _expected_handle(
        rank, world, [inp[1] for inp in all_inputs], 2)
    _equal(handle[0], rank_prefix, "rank_prefix_matrix")
    _equal(handle[1], channel_prefix, "channel_prefix_matrix")
    assert handle[2].shape == (world, 2) and handle[2].dtype == torch.int32
    _equal(handle[3], recv_src_idx, "recv_src_idx")
    _equal(handle[4], want_in_rank, "is_token_in_rank")
    _equal(handle[5], send_head, "send_head")
    # DeepEP users read the rows each source sent from the rank prefix matrix
    assert int(handle[0][-1, rank]) == recv_x.shape[0]

    # route-only: no top-k, rows by is_token_in_rank; counts from num_tokens_per_expert, as DeepEP
    ro = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    _equal(ro[0], recv_x, "route-only recv_x")
    assert ro[1] is None and ro[2] is None
    all_per_expert = [bf.layout(inp[1], E, world)[1] for inp in all_inputs]
    assert ro[3] == [sum(int(pe[rank * PER_RANK + e]) for pe in all_per_expert) for e in range(PER_RANK)]
    _equal(ro[4][0], rank_prefix, "route-only rank_prefix_matrix")

    # cached dispatch: (recv_x, None, None, None, None, event); a rebuilt tuple works too
    again = buf.dispatch(x * 2, handle=handle, previous_event=deep_ep.Buffer.capture())
    assert len(again) == 6 and again[1:5] == (None, None, None, None)
    _equal(again[0], dc.dispatch(x * 2, handle=want[4])[0], "cached recv_x")
    _equal(buf.dispatch(x, handle=tuple(handle))[0], recv_x, "cached with a rebuilt tuple")
    with pytest.raises(ValueError, match="^topk_idx"):
        buf.dispatch(x, handle=handle, topk_idx=idx)
    with pytest.raises(ValueError, match="^handle"):
        buf.dispatch(x, handle=(handle[0].clone(),) + tuple(handle[1:]))

    # FP8 pair in, FP8 pair out
    pair = per_token_cast_to_fp8(x)
    got_pair = buf.dispatch(pair, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)[0]
    want_pair = dc.dispatch(pair, topk_idx=idx, topk_weights=w, num_experts=E)[0]
    assert isinstance(got_pair, tuple)
    _equal(got_pair[0], want_pair[0], "fp8 values")
    _equal(got_pair[1], want_pair[1], "fp8 scales")

    # combine: 3-tuple, same results; bias added once in fp32
    y = (recv_x.float() * 0.5).to(torch.bfloat16)
    combined = buf.combine(y, handle, topk_weights=recv_w, config=deep_ep.Config(8))
    assert len(combined) == 3 and combined[2].event is None
    assert dc.num_sms == 8
    want_c = dc.combine(y, want[4], topk_weights=recv_w)
    _equal(combined[0], want_c[0], "combined_x")
    _equal(combined[1], want_c[1], "combined_w")
    bias = torch.full_like(x, 0.25)
    _equal(buf.combine(y, handle, bias=(bias, bias))[0], (want_c[0].float() + 0.5).to(torch.bfloat16), "bias pair")
    _equal(buf.combine(y, list(handle), bias=bias)[0], (want_c[0].float() + 0.25).to(torch.bfloat16), "bias")
    with pytest.raises(ValueError, match="^bias"):
        buf.combine(y, handle, bias=bias[:, :8].contiguous())
    assert dc.num_sms == deep_ep.Buffer.num_sms

    # num_worst_tokens: padded outputs, DeepEP's empty per-expert list
    worst_n = 32 * world
    worst = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                         num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, num_worst_tokens=worst_n)
    want_worst = dc.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, num_worst_tokens=worst_n)
    assert worst[0].shape[0] == worst_n and worst[3] == [] and len(worst[4]) == 6
    for got_t, want_t, name in zip(worst[:3], want_worst[:3], ("worst x", "worst idx", "worst w")):
        _equal(got_t, want_t, name)
    n = recv_x.shape[0]
    padded_y = torch.cat([y, torch.zeros(worst_n - n, HIDDEN, dtype=y.dtype)])
    _equal(buf.combine(padded_y, worst[4])[0], want_c[0], "combine of padded rows")

    # bad input names the argument
    with pytest.raises(ValueError, match="^num_tokens_per_rank"):
        buf.dispatch(x, topk_idx=idx, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    with pytest.raises(ValueError, match="^config"):
        buf.dispatch(x, handle=handle, config=deep_ep.Config(3))
    with pytest.raises(ValueError, match="^allocate_on_comm_stream"):
        buf.dispatch(x, handle=handle, allocate_on_comm_stream=True)
    buf.destroy()
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_normal_mode(world):
    assert run_ranks(_normal_worker, world) == [True] * world


# ---- low-latency mode ------------------------------------------------------------------------------------------
def _low_latency_worker(rank, world):
    from deepcomm.compat import deep_ep
    from deepcomm.fp8 import pack_ue8m0
    E, M = PER_RANK * world, 16
    buf = deep_ep.Buffer(dist.group.WORLD, 0, deep_ep.Buffer.get_low_latency_rdma_size_hint(M, HIDDEN, world, E),
                         low_latency_mode=True, num_qps_per_rank=PER_RANK, enable_shrink=world > 2, hidden=HIDDEN,
                         backend="reference")
    dc = buf.runtime
    all_inputs = [_inputs(r, world, [5, 9, 12][r]) for r in range(world)]
    x, idx, w = all_inputs[rank]
    stats = torch.zeros(PER_RANK, dtype=torch.int32)
    buf.clean_low_latency_buffer(M, HIDDEN, E)

    out = buf.low_latency_dispatch(x, idx, M, E, cumulative_local_expert_recv_stats=stats, use_fp8=True,
                                   round_scale=True, use_ue8m0=True)
    assert len(out) == 5 and out[4] is None
    (values, packed), count, handle, event, _ = out
    want_x, want_count, want_handle, _ = dc.low_latency_dispatch(x, idx, M, E, use_fp8=True, use_ue8m0=True)
    _equal(values, want_x[0], "ll values")
    _equal(count, want_count, "ll count")
    assert packed.dtype == torch.int32 and packed.shape == (PER_RANK, world * M, HIDDEN // 512)
    assert packed.stride()[1:] == (1, world * M)   # column-major in the last two dims, like DeepEP
    _equal(packed.contiguous(), pack_ue8m0(want_x[1]), "ll packed scales")
    torch.testing.assert_close(stats, want_count)

    # DeepEP's handle: (src_info, layout_range, M, hidden, num_experts); layout_range = begin << 32 | count
    assert isinstance(handle, tuple) and len(handle) == 5 and handle[2:] == (M, HIDDEN, E)
    src_info, layout_range = handle[0], handle[1]
    assert src_info.dtype == torch.int32 and src_info.shape == (PER_RANK, world * M)
    assert layout_range.dtype == torch.int64 and layout_range.shape == (PER_RANK, world)
    begin, num = layout_range >> 32, layout_range & 0xFFFFFFFF
    for e in range(PER_RANK):
        assert int(num[e].sum()) == int(count[e])
        for s in range(world):
            want_tokens = [t for t in range(all_inputs[s][1].shape[0])
                           if rank * PER_RANK + e in all_inputs[s][1][t].tolist()]
            b, c = int(begin[e, s]), int(num[e, s])
            assert src_info[e, b:b + c].tolist() == want_tokens, (e, s)

    # hook mode; bf16 without fp8; a rebuilt tuple is still this dispatch's handle
    recv, count2, handle2, _, hook = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False, return_recv_hook=True)
    assert callable(hook)
    hook()
    hook()
    want_bf16 = dc.low_latency_dispatch(x, idx, M, E, use_fp8=False)[0]
    _equal(recv, want_bf16, "ll bf16 recv")
    y = buf.get_next_low_latency_combine_buffer(tuple(handle2))
    assert y.shape == recv.shape and y.dtype == torch.bfloat16
    y.copy_(recv)
    target = torch.empty(x.shape, dtype=torch.bfloat16)
    combined, event, hook = buf.low_latency_combine(y, idx, w, tuple(handle2), zero_copy=True, out=target,
                                                    async_finish=True)
    assert combined is target and hook is None
    event.current_stream_wait()
    _equal(combined, dc.low_latency_combine(recv, idx, w, handle2.deepcomm)[0], "ll combine")

    with pytest.raises(ValueError, match="^dispatch_wait_recv_cost_stats"):
        buf.low_latency_dispatch(x, idx, M, E, dispatch_wait_recv_cost_stats=torch.zeros(world, dtype=torch.int64))
    with pytest.raises(ValueError, match="^use_logfmt"):
        buf.low_latency_combine(y, idx, w, handle2, use_logfmt=True)
    with pytest.raises(ValueError, match="^combine_wait_recv_cost_stats"):
        buf.low_latency_combine(y, idx, w, handle2, combine_wait_recv_cost_stats=torch.zeros(world, dtype=torch.int64))

    # shrink mode: masking is deepcomm's mask_ranks / unmask_ranks
    status = torch.zeros(world, dtype=torch.int32)
    if world <= 2:
        with pytest.raises(ValueError, match="^enable_shrink"):
            buf.low_latency_query_mask_buffer(status)
    else:
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0] * world
        gone = world - 1
        if rank != gone:
            buf.low_latency_update_mask_buffer(gone, True)
            buf.low_latency_query_mask_buffer(status)
            assert status.tolist() == [int(r == gone) for r in range(world)]
            with pytest.raises(ValueError, match="^mask"):
                buf.low_latency_update_mask_buffer(gone, False)
            buf.low_latency_update_mask_buffer(0 if rank else 1, False)   # not masked: nothing to do
            with pytest.raises(ValueError, match="^rank_to_mask"):
                buf.low_latency_update_mask_buffer(rank, True)
        buf.low_latency_clean_mask_buffer()                                # collective: every rank
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0] * world
    buf.destroy()
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_low_latency_mode(world):
    assert run_ranks(_low_latency_worker, world) == [True] * world


# ---- internode handle (one host posing as nodes) ---------------------------------------------------------------
def _internode_worker(rank, world):
    from deepcomm.compat import deep_ep
    E = PER_RANK * world
    buf = deep_ep.Buffer(dist.group.WORLD, int(1e9), int(1e9), max_tokens_per_rank=32, hidden=HIDDEN, gpus_per_node=1,
                         backend="reference")
    assert buf.num_rdma_ranks == world
    all_inputs = [_inputs(r, world, _tokens(world)[r]) for r in range(world)]
    x, idx, w = all_inputs[rank]
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    _equal(per_rdma_rank, per_rank, "one GPU per node: per RDMA rank = per rank")
    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    assert isinstance(handle, tuple) and len(handle) == 10
    _equal(handle[0], in_rank, "is_token_in_rank")
    counts_from = torch.stack([bf.layout(inp[1], E, world)[0] for inp in all_inputs])[:, rank]
    _equal(handle[6], counts_from.cumsum(0).to(torch.int32), "recv_gbl_rank_prefix_sum")
    assert handle[7].shape[0] == recv_x.shape[0] and handle[7].dtype == torch.uint8
    combined = buf.combine(recv_x, handle)[0]
    want = sum(in_rank[:, d:d + 1].float() for d in range(world)) * x.float()
    _equal(combined, want.to(torch.bfloat16), "internode combine")
    buf.destroy()
    return True


def test_internode_handle_posed_nodes():
    assert run_ranks(_internode_worker, 2) == [True, True]


# ---- get_local_buffer_tensor and the runtime ---------------------------------------------------------------------
def _local_buffer_worker(rank, world):
    from deepcomm.compat import deep_ep
    E, M, H = PER_RANK * world, 8, HIDDEN
    nvl = deep_ep.Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(H * 2, world)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, world, E)
    buf = deep_ep.Buffer(dist.group.WORLD, nvl, rdma, low_latency_mode=True, backend="reference")
    whole = buf.get_local_buffer_tensor(torch.uint8)
    assert whole.shape == (nvl,) and whole.dtype == torch.uint8 and whole.device == buf.buffer.device
    floats = buf.get_local_buffer_tensor(torch.float32, offset=16)
    assert floats.shape == ((nvl - 16) // 4,)
    shaped = buf.get_local_buffer_tensor(torch.float32, torch.Size([3, 5]), offset=16)
    assert shaped.shape == (3, 5)
    shaped.copy_(torch.arange(15, dtype=torch.float32).view(3, 5) + rank)
    # the same memory on every call: what one view wrote, a later one reads
    again = buf.get_local_buffer_tensor(torch.float32, (15,), 16)
    assert again.tolist() == [float(i + rank) for i in range(15)]
    assert whole[16:20].view(torch.float32).item() == float(rank)
    assert buf.runtime.get_local_buffer_tensor(torch.float32, 16)[:15].tolist() == again.tolist()
    # the RDMA region is another one, num_rdma_bytes long
    raw = buf.get_local_buffer_tensor(torch.int32, None, 0, True)
    assert raw.numel() == rdma // 4
    raw.fill_(1)
    assert again.tolist() == [float(i + rank) for i in range(15)]
    # deepcomm's kernels do not use it: a dispatch and combine leave it as it was
    x, idx, w = _inputs(rank, world, 6)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert)
    buf.combine(recv_x, handle)
    assert bool((raw == 1).all()) and again.tolist() == [float(i + rank) for i in range(15)]
    # clean_low_latency_buffer zeroes DeepEP's signalling words (num_experts ints at the start of each half)
    buf.clean_low_latency_buffer(M, H, E)
    assert int((raw == 0).sum()) == 2 * E and bool((raw[:E] == 0).all())
    # offset and size are checked against the region
    for kwargs, name in (({"offset": -4}, "offset"), ({"offset": nvl + 4}, "offset"), ({"offset": 2}, "offset"),
                         ({"size": torch.Size([nvl])}, "size"), ({"size": 7}, "size")):
        with pytest.raises(ValueError, match=f"^{name}"):
            buf.get_local_buffer_tensor(torch.float32, **kwargs)
    with pytest.raises(ValueError, match="^dtype"):
        buf.get_local_buffer_tensor("float32")
    with pytest.raises(ValueError, match="^size"):
        buf.get_local_buffer_tensor(torch.int32, torch.Size([rdma // 4 + 1]), use_rdma_buffer=True)
    assert buf.get_local_buffer_tensor(torch.int64, offset=nvl).numel() == 0
    buf.destroy()
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_get_local_buffer_tensor(world):
    assert run_ranks(_local_buffer_worker, world) == [True] * world


def _runtime_names():
    src = open(os.path.join(PEER, "csrc", "deep_ep.cpp")).read()
    block = src[src.index("class_<deep_ep::Buffer>"):src.index('m.def("is_sm90_compiled"')]
    hpp = open(os.path.join(PEER, "csrc", "deep_ep.hpp")).read()
    names = set(re.findall(r'\.def\("(\w+)"', block))
    return sorted(names | ({"is_internode_available"} if "is_internode_available" in hpp else set()))


def _runtime_worker(rank, world, names):
    from deepcomm.compat import deep_ep
    from deepcomm.compat.deep_ep import _cpp
    E, M = PER_RANK * world, 8
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(M, HIDDEN, world, E)
    buf = deep_ep.Buffer(dist.group.WORLD, 2 ** 20, rdma, low_latency_mode=True, enable_shrink=True,
                         backend="reference")
    rt = buf.runtime
    assert isinstance(rt, _cpp.Buffer)
    answered, refused = [], []
    for name in names:  # every name of DeepEP's runtime is there: a call, or a RuntimeError saying why not
        try:
            assert callable(getattr(rt, name)), name
            answered.append(name)
        except RuntimeError as exc:
            assert name in str(exc) and "deep_ep.Buffer" in str(exc), exc
            refused.append(name)
    assert sorted(refused) == ["internode_combine", "internode_dispatch", "intranode_combine", "intranode_dispatch"]
    assert rt.is_available() and not rt.is_internode_available()
    assert (rt.get_num_rdma_ranks(), rt.get_rdma_rank(), rt.get_local_device_id()) == (1, 0, -1)
    assert rt.get_root_rdma_rank(True) == rank and rt.get_root_rdma_rank(False) == 0
    assert rt.get_comm_stream() is None  # CPU: no stream
    # DeepEP's second construction step: already done, its arguments checked
    assert rt.sync([rt.get_local_device_id()] * world, [None] * world, None) is None
    with pytest.raises(ValueError, match="^device_ids"):
        rt.sync([0] * (world + 1), [None] * world, None)
    for name in ("get_local_ipc_handle", "get_local_nvshmem_unique_id"):
        with pytest.raises(RuntimeError, match=f"^{name}"):
            getattr(rt, name)()
    # the calls with deep_ep.Buffer's arguments
    rt.clean_low_latency_buffer(M, HIDDEN, E)
    x, idx, w = _inputs(rank, world, 5)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    nxt = rt.get_next_low_latency_combine_buffer(M, HIDDEN, E)
    assert nxt is buf.get_next_low_latency_combine_buffer(handle) and nxt.shape == recv.shape
    with pytest.raises(ValueError, match="^num_experts"):
        rt.get_next_low_latency_combine_buffer(M, HIDDEN, E + 1)
    status = torch.zeros(world, dtype=torch.int32)
    rt.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * world
    rt.low_latency_clean_mask_buffer()
    # deepcomm's own API stays reachable through the runtime
    assert rt.backend_name == "reference" and rt.world_size == world
    with pytest.raises(AttributeError, match="no_such_call"):
        rt.no_such_call
    rt.destroy()
    assert not rt.is_available()
    with pytest.raises(RuntimeError, match="^sync"):
        rt.sync([], [], None)
    return True


@pytest.mark.skipif(not os.path.isdir(PEER), reason="DeepEP V1's source is not here")
def test_runtime_has_every_deep_ep_runtime_call():
    names = _runtime_names()
    assert "get_local_buffer_tensor" in names and "sync" in names
    assert run_ranks(_runtime_worker, 2, names) == [True, True]


# ---- automatic sizing: DeepEP's byte budget, deepcomm's buffers grown to the calls -------------------------------
def _auto_size_worker(rank, world):
    import deepcomm
    from deepcomm.compat import deep_ep
    from deepcomm.compat.deep_ep.sizes import START_HIDDEN, START_TOKENS
    E, H = PER_RANK * world, START_HIDDEN + 512
    cfg = deep_ep.Buffer.get_dispatch_config(world)
    nvl = max(cfg.get_nvl_buffer_size_hint(H * 2, world),
              deep_ep.Buffer.get_combine_config(world).get_nvl_buffer_size_hint(H * 2, world))
    buf = deep_ep.Buffer(dist.group.WORLD, nvl, 0, backend="reference")   # what a DeepEP user passes
    assert buf.buffer.config.max_tokens_per_rank == START_TOKENS
    ref = deepcomm.Buffer(dist.group.WORLD, max_tokens_per_rank=1024, hidden=H, backend="reference")

    def inputs(tokens, seed):
        gen = torch.Generator().manual_seed(seed + rank)
        idx = bf.make_topk(gen, tokens, SLOTS, E, p_empty=0.25)
        return torch.randn(tokens, H, generator=gen).to(torch.bfloat16), idx, torch.rand(tokens, SLOTS, generator=gen)

    def dispatch(x, idx, w, **kw):
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        return buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, **kw)

    # first call: hidden over the start, token counts under it
    x1, idx1, w1 = inputs([20, 3, 9][rank], 1)
    first = dispatch(x1, idx1, w1)
    assert buf.buffer.config.hidden == H
    want1 = ref.dispatch(x1, topk_idx=idx1, topk_weights=w1, num_experts=E)
    for got, want, name in zip(first[:3], want1[:3], ("x", "idx", "w")):
        _equal(got, want, name)
    # one rank alone over the tokens: every rank grows to it, the call runs
    big = START_TOKENS * 2 + 44
    x2, idx2, w2 = inputs([7, big, 1][rank] if world > 1 else big, 2)
    second = dispatch(x2, idx2, w2)
    assert buf.buffer.config.max_tokens_per_rank >= big
    want2 = ref.dispatch(x2, topk_idx=idx2, topk_weights=w2, num_experts=E)
    _equal(second[0], want2[0], "grown recv_x")
    # the handle from before the growth still combines and re-dispatches (through the outgrown Buffer)
    _equal(buf.combine(first[0], first[4])[0], ref.combine(want1[0], want1[4])[0], "old handle combine")
    _equal(buf.dispatch(x1, handle=first[4])[0], first[0], "old handle cached dispatch")
    _equal(buf.combine(second[0], second[4])[0], ref.combine(want2[0], want2[4])[0], "new handle combine")
    # worst-case form (graph-capturable): sized from num_worst_tokens, the same on every rank
    worst = world * 1024
    padded = dispatch(x1, idx1, w1, num_worst_tokens=worst)
    assert padded[0].shape[0] == worst and buf.buffer.config.max_tokens_per_rank >= 1024
    n = first[0].shape[0]
    _equal(padded[0][:n], first[0], "worst recv_x")
    assert bool((padded[1][n:] == -1).all())
    # a call DeepEP's buffer of num_nvl_bytes could not carry: ValueError naming it, on every rank
    with pytest.raises(ValueError, match="^num_nvl_bytes"):
        dispatch(x1, idx1, w1, config=deep_ep.Config(cfg.num_sms * 2, 6, 256))
    with pytest.raises(ValueError, match="^num_nvl_bytes"):
        buf.combine(first[0], first[4], config=deep_ep.Config(cfg.num_sms, 6, 512))
    buf.destroy()

    # low-latency only (num_nvl_bytes=0): normal mode does not fit; low-latency grows hidden, M is DeepEP's to bound
    M = 8
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(M, H, world, E)
    ll = deep_ep.Buffer(dist.group.WORLD, 0, rdma, low_latency_mode=True, backend="reference")
    x, idx, w = inputs(5, 3)
    per_rank, _, per_expert, in_rank, _ = ll.get_dispatch_layout(idx, E)
    with pytest.raises(ValueError, match="^num_nvl_bytes"):
        ll.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    ll.clean_low_latency_buffer(M, H, E)
    recv, count, handle, _, _ = ll.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    want = ref.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    _equal(recv, want[0], "ll recv")
    _equal(ll.low_latency_combine(recv, idx, w, handle)[0], ref.low_latency_combine(want[0], idx, w, want[2])[0],
           "ll combine")
    with pytest.raises(ValueError, match="^num_rdma_bytes"):
        ll.low_latency_dispatch(x, idx, 2 * M, E, use_fp8=False)
    with pytest.raises(ValueError, match="^num_rdma_bytes"):
        ll.clean_low_latency_buffer(M, 2 * H, E)
    ll.destroy()
    ref.destroy()
    return True


@pytest.mark.parametrize("world", [1, 2, 3])
def test_automatic_sizing(world):
    assert run_ranks(_auto_size_worker, world, timeout=300) == [True] * world


def test_byte_counts_are_aligned_as_in_deep_ep():
    from deepcomm.compat import deep_ep
    for kwargs, name in (({"num_nvl_bytes": 1000}, "num_nvl_bytes"), ({"num_rdma_bytes": 64}, "num_rdma_bytes")):
        with pytest.raises(ValueError, match=f"^{name}"):
            deep_ep.Buffer(None, **kwargs)


def test_low_latency_token_bound_follows_the_byte_budget():
    from deepcomm.compat.deep_ep import fit
    from deepcomm.compat.deep_ep._cpp import low_latency_layout_bytes
    for world, budget in ((2, 10 ** 6), (8, 10 ** 8), (3, 128)):
        m = fit.max_low_latency_tokens(budget, world)
        # no shape fits more tokens per rank than the smallest one (hidden 128, one expert per rank) does
        assert low_latency_layout_bytes(m + 1, 128, world)["total"] > budget
        assert m == 1 or low_latency_layout_bytes(m, 128, world)["total"] <= budget
