"""A few small dispatch/combine rounds of the intranode kernels, normal and low-latency mode, and of the internode
kernels (the 2 GPUs posing as 2 nodes x 1: hier_dispatch / hier_combine with their poster and emulated-NIC
blocks), for compute-sanitizer.

One process per GPU, started by dev/sanitize.sh with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, each
under its own compute-sanitizer. No reference backend (its NCCL kernels would only slow the sanitizer down):
results are checked against values known without the peers' data. Kernels run much slower under the sanitizer,
so the Buffer's wait timeout is raised (--timeout-s). Prints one "ok" line per rank and exits 0 when every
check passed.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def _normal_rounds(buf, gen, E: int, K: int, T: int, H: int) -> int:
    from deepcomm.fp8 import per_token_cast_to_fp8
    dev = buf.device
    rounds = 0
    for use_fp8, masked in ((False, False), (True, True)):
        idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
        if masked:
            idx[torch.rand(T, K, generator=gen) < 0.3] = -1
        idx = idx.to(dev)
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
        w = torch.rand(T, K, generator=gen).to(dev)
        payload = per_token_cast_to_fp8(x, use_ue8m0=False) if use_fp8 else x
        recv_x, recv_idx, recv_w, _, handle = buf.dispatch(payload, topk_idx=idx, topk_weights=w, num_experts=E)
        cached = buf.dispatch(payload, handle=handle)  # the cached route: same rows again
        got = recv_x[0] if use_fp8 else recv_x
        again = cached[0][0] if use_fp8 else cached[0]
        assert torch.equal(got.view(torch.uint8), again.view(torch.uint8)), "cached dispatch differs"
        # Combine the rows as received (bf16): every copy comes back unchanged, so token t gets copies(t) * x[t]
        # exactly when the payload was bf16.
        rows = got.to(torch.bfloat16) if use_fp8 else got
        out, _ = buf.combine(rows, handle)
        if not use_fp8:
            copies = handle.is_token_in_rank.sum(dim=1, dtype=torch.float32)
            assert torch.equal(out, (x.float() * copies[:, None]).to(torch.bfloat16)), "normal combine"
        assert out.shape == (T, H) and bool(torch.isfinite(out.float()).all())
        rounds += 1
    return rounds


def _low_latency_rounds(buf, gen, E: int, K: int, T: int, H: int, M: int) -> int:
    dev = buf.device
    rounds = 0
    for use_fp8, hook in ((False, False), (True, False), (False, True)):
        idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.to(dev)
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
        w = torch.rand(T, K, generator=gen).to(dev)
        recv_x, recv_count, handle, recv_hook = buf.low_latency_dispatch(x, idx, M, E, use_fp8=use_fp8,
                                                                         return_recv_hook=hook)
        recv_hook()
        assert int(recv_count.sum()) <= buf.world_size * T * K
        y = recv_x if not use_fp8 else torch.randn(E // buf.world_size, buf.world_size * M, H,
                                                   generator=gen).to(torch.bfloat16).to(dev)
        out, comb_hook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook)
        comb_hook()
        if not use_fp8:  # the expert outputs are the received rows: sum_k w_k * x_t, up to rounding order
            want = x.float() * w.sum(dim=1, keepdim=True)
            assert torch.allclose(out.float(), want, rtol=2e-2, atol=2e-2), "low-latency combine"
        assert bool(torch.isfinite(out.float()).all())
        rounds += 1
    # every slot names expert 0: more entries than its R * M rows. Reported (ValueError at the next look), and
    # memcheck proves nothing lands out of bounds.
    flood = torch.zeros(T, K, dtype=torch.int64, device=dev)
    buf.low_latency_dispatch(torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev), flood, M, E)
    try:
        buf.synchronize()
        raise AssertionError("a flood of duplicate ids was not reported")
    except ValueError as e:
        assert "topk_idx" in str(e), e
    return rounds + 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--timeout-s", type=float, default=120.0, help="deepcomm wait timeout (sanitized kernels are slow)")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", local))
    import deepcomm
    gen = torch.Generator().manual_seed(99 + rank)
    M = a.tokens
    buf = deepcomm.Buffer(backend="cuda", max_tokens_per_rank=a.tokens, hidden=a.hidden, num_sms=4,
                          num_max_low_latency_tokens=M, timeout_s=a.timeout_s)
    rounds = _normal_rounds(buf, gen, a.experts, a.topk, a.tokens, a.hidden)
    rounds += _low_latency_rounds(buf, gen, a.experts, a.topk, a.tokens, a.hidden, M)
    buf.synchronize()
    buf.destroy()
    # the internode kernels: the same normal rounds (their checks hold for any route) on 2 nodes x 1 GPU
    inter = deepcomm.Buffer(backend="cuda", max_tokens_per_rank=a.tokens, hidden=a.hidden, num_sms=4,
                            gpus_per_node=1, timeout_s=a.timeout_s)
    assert type(inter._backend).__name__ == "InternodeBackend" and inter._backend.kernels is not None
    rounds += _normal_rounds(inter, gen, a.experts, a.topk, a.tokens, a.hidden)
    inter.synchronize()
    inter.destroy()
    dist.barrier()
    dist.destroy_process_group()
    print(f"sanitize driver rank {rank}: ok, {rounds} rounds", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
