"""Plain calls read by the C++ argument reader (deepcomm/cuda/arg_reader.py) on a GPU at world size 1: fresh
dispatches (BF16, the FP8 pair, activations that require grad), cached dispatches and combines take it, bit for bit
what the Python path returns, on the stream that is current; a fresh dispatch is refused while a CUDA graph is
being captured (the Python path then names num_worst_tokens)."""
import pytest
import torch

from tests.helpers.nccl_run import cuda_buffer, gpu_count, run_on_gpus

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")]

T, H, K, E = 96, 7168, 8, 64


def _same(a, b) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return a == b


def _outputs(out):
    recv_x, recv_idx, recv_w, per_expert, h = out
    return (recv_x, recv_idx, recv_w, tuple(per_expert), h.num_recv, h.send_pos, h.count_matrix,
            h.recv_src_idx, h.is_token_in_rank)


def _worker(rank, world):
    from deepcomm.cuda.arg_reader import exchange_api
    from deepcomm.fp8 import per_token_cast_to_fp8
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = cuda_buffer(max_tokens_per_rank=128, hidden=H, num_sms=24)
    be = buf._backend
    assert (buf._arg_reader is not None) == (exchange_api() is not None)
    if buf._arg_reader is None:
        return  # this torch has no exchange table: the Python path is the only one (the other GPU tests cover it)
    reads = []
    real_read, real_combine_read = be.dispatch_read, be.combine_read
    be.dispatch_read = lambda read, *a: reads.append(read) or real_read(read, *a)
    be.combine_read = lambda read, *a: reads.append(read) or real_combine_read(read, *a)
    gen = torch.Generator(device=dev).manual_seed(7)
    idx = torch.randint(-1, E, (T, K), device=dev, generator=gen)
    w = torch.rand(T, K, device=dev, generator=gen)
    x = torch.randn(T, H, device=dev, generator=gen).to(torch.bfloat16)
    fp8 = per_token_cast_to_fp8(x)
    grad_x = x.float().requires_grad_().to(torch.bfloat16)
    expected = {}
    for name, xx, ww in (("bf16", x, w), ("bf16 no weights", x, None), ("fp8", fp8, w), ("requires grad", grad_x, w)):
        before = len(reads)
        read_out = _outputs(buf.dispatch(xx, idx, ww, num_experts=E))
        assert len(reads) == before + 1, name
        saved, buf._arg_reader = buf._arg_reader, None
        python_out = _outputs(buf.dispatch(xx, idx, ww, num_experts=E))
        buf._arg_reader = saved
        assert len(reads) == before + 1, name
        torch.cuda.synchronize()
        assert _same(read_out, python_out), name
        expected[name] = python_out
    # a cached dispatch and a combine of a handle, read and through Python
    recv_x, _, recv_w, _, handle = buf.dispatch(x, idx, w, num_experts=E)
    y = (recv_x.float() * 0.5).to(torch.bfloat16)
    for name, call in (("cached", lambda: buf.dispatch(x, handle=handle)[0]),
                       ("cached fp8", lambda: buf.dispatch(fp8, handle=handle)[0]),
                       ("combine", lambda: buf.combine(y, handle, recv_w)),
                       ("combine, no weights", lambda: buf.combine(y, handle)[0])):
        before = len(reads)
        read_out = call()
        assert len(reads) == before + 1, name
        saved, buf._arg_reader = buf._arg_reader, None
        python_out = call()
        buf._arg_reader = saved
        assert len(reads) == before + 1, name
        torch.cuda.synchronize()
        assert _same(read_out, python_out), name
    # the current stream, asked of torch through the exchange table
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = buf.dispatch(x, idx, w, num_experts=E)
    assert reads[-1][3] == side.cuda_stream
    torch.cuda.current_stream().wait_stream(side)
    del out
    # while a graph is captured the reader refuses (a fresh dispatch waits for its counts); the Buffer then raises
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        refused = buf._arg_reader.fresh(x, idx, w, E, 1, 1)
        torch.zeros(1, device=dev)
    assert refused is None
    torch.cuda.synchronize()
    after = _outputs(buf.dispatch(x, idx, w, num_experts=E))
    torch.cuda.synchronize()
    assert _same(after, expected["bf16"])
    buf.destroy()


def test_read_path_at_world_size_1():
    run_on_gpus(_worker, 1)
