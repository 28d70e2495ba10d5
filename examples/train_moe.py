"""Train a small expert-parallel MoE layer (deepcomm.moe.MoELayer) on a synthetic regression task.

The task: learn a fixed random smooth function (a two-layer tanh network) of random inputs. Every rank draws its own tokens each step; the experts are sharded over the ranks, the router
is replicated (its gradient is summed over the group). The loss printed is the mean over all ranks and must fall.

    python examples/train_moe.py                      # 2 CPU processes (gloo, reference backend)
    python examples/train_moe.py --world-size 4 --steps 500   # --experts must divide by the world size
    python examples/train_moe.py --device cuda        # one process per GPU (NCCL, backend auto = CUDA kernels)
    torchrun --nproc-per-node 2 examples/train_moe.py # under torchrun / launch/torchrun.sh: uses its ranks
    bash launch/mpirun.sh -np 2 examples/train_moe.py # under MPI (deepcomm.launch_mpi makes the group)

Without ``--device`` it picks cuda when GPUs are visible, else cpu. On the CUDA backend the model runs in bf16.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
from typing import List

import torch
import torch.distributed as dist


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=None,
                   help="processes to spawn (default: GPU count with --device cuda, else 2)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--backend", choices=["auto", "cuda", "reference"], default="auto", help="deepcomm backend")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn-hidden", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank per step")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25, help="print every N steps (0: only the summary)")
    return p.parse_args(argv)


def _teacher(args, device):
    """A fixed random two-layer network, ``target = tanh(x @ A) @ B``: smooth, so a freshly initialised MoE can
    fit it in a few hundred steps."""
    gen = torch.Generator().manual_seed(10_000 + args.seed)
    h = args.hidden
    a = torch.randn(h, 2 * h, generator=gen) / h ** 0.5
    b = torch.randn(2 * h, h, generator=gen) / (2 * h) ** 0.5
    return a.to(device), b.to(device)


def train(rank: int, world: int, args) -> List[float]:
    """The training loop; needs torch.distributed initialised. Returns the all-rank mean loss of every step."""
    import deepcomm
    from deepcomm.moe import MoELayer

    buf = deepcomm.Buffer(max_tokens_per_rank=args.tokens, hidden=args.hidden, backend=args.backend)
    torch.manual_seed(args.seed)              # same router init everywhere (it is replicated) ...
    layer = MoELayer(buf, args.hidden, args.ffn_hidden, args.experts, args.topk)
    with torch.no_grad():                     # ... and different experts per rank
        gen = torch.Generator().manual_seed(args.seed + 1 + rank)
        layer.w_gate_up.copy_(torch.randn(layer.w_gate_up.shape, generator=gen) / args.hidden ** 0.5)
        layer.w_down.copy_(torch.randn(layer.w_down.shape, generator=gen) / args.ffn_hidden ** 0.5)
    dtype = layer.w_down.dtype
    teacher_a, teacher_b = _teacher(args, buf.device)
    opt = torch.optim.Adam(layer.parameters(), lr=args.lr)
    data_gen = torch.Generator().manual_seed(1_000_000 * (args.seed + 1) + rank)
    if rank == 0 and args.log_every:
        print(f"[train_moe] {world} ranks, backend={buf.backend_name}, device={buf.device}, dtype={dtype}, "
              f"{args.experts} experts top-{args.topk}, hidden {args.hidden}, {args.tokens} tokens/rank/step",
              flush=True)
    losses = []
    for step in range(args.steps):
        x32 = torch.randn(args.tokens, args.hidden, generator=data_gen).to(buf.device)
        target = torch.tanh(x32 @ teacher_a) @ teacher_b
        y = layer(x32.to(dtype))
        loss = torch.nn.functional.mse_loss(y.float(), target)
        opt.zero_grad(set_to_none=True)
        (loss / world).backward()             # gradient of the mean over ranks
        layer.sync_replicated_grads()         # router: sum the per-rank parts
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0 and args.log_every and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"[train_moe] step {step:4d}  loss {losses[-1]:.5f}", flush=True)
    if rank == 0 and args.log_every:
        print(f"[train_moe] loss {losses[0]:.5f} -> {losses[-1]:.5f} ({losses[-1] / losses[0]:.2%} of the start)",
              flush=True)
    buf.destroy()
    return losses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, use_cuda: bool, args) -> None:
    if use_cuda:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
    try:
        train(rank, world, args)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    args = parse_args(argv)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if dist.is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        # launched by torchrun, or by deepcomm.launch_mpi (which already made the group)
        made_group = not dist.is_initialized()
        if made_group:
            if use_cuda:
                local = int(os.environ.get("LOCAL_RANK", "0"))
                torch.cuda.set_device(local)
                dist.init_process_group("nccl", device_id=torch.device("cuda", local))
            else:
                dist.init_process_group("gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            if made_group:
                dist.destroy_process_group()
        return 0
    world = args.world_size or (torch.cuda.device_count() if use_cuda else 2)
    if use_cuda and world > torch.cuda.device_count():
        print(f"train_moe: --world-size {world} needs {world} GPUs, {torch.cuda.device_count()} visible",
              file=sys.stderr)
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.multiprocessing.spawn(_worker, args=(world, _free_port(), use_cuda, args), nprocs=world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
