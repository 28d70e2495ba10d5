"""One dispatch + combine across every rank, checked; exits 0 when the job's communication works.

Run it wherever you would run the real job, to check the set-up (ranks, rendezvous, network) first:

    torchrun --nnodes 2 --node-rank R --master-addr HOST --master-port P --nproc-per-node 8 launch/smoke_dispatch.py
    bash launch/mpirun.sh -np 16 launch/smoke_dispatch.py
    python launch/smoke_dispatch.py --device cpu      # alone: one process

Uses torch.distributed's default group when the launcher (deepcomm.launch_mpi) already made it, else initialises
from the torchrun variables (NCCL on GPUs, gloo on the CPU). deepcomm backend "auto" (``--backend`` to force).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, when not installed

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="deepcomm dispatch/combine smoke test across all ranks")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--backend", choices=["auto", "cuda", "reference"], default="auto")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    args = p.parse_args(argv)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    made_group = False
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # alone
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=120))
        made_group = True
    import deepcomm

    rank, world = dist.get_rank(), dist.get_world_size()
    buf = deepcomm.Buffer(max_tokens_per_rank=args.tokens, hidden=args.hidden, backend=args.backend)
    experts, topk = 4 * world, min(4, 4 * world)
    gen = torch.Generator().manual_seed(rank)
    idx = torch.rand(args.tokens, experts, generator=gen).topk(topk, dim=1).indices.to(buf.device)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to(device=buf.device, dtype=torch.bfloat16)
    recv_x, _, _, _, handle = buf.dispatch(x, topk_idx=idx, num_experts=experts)
    out, _ = buf.combine(recv_x, handle)
    copies = handle.is_token_in_rank.sum(1, keepdim=True).float()  # combine sums one copy per rank
    ok = torch.allclose(out.float(), x.float() * copies, rtol=1e-2, atol=1e-2)
    flag = torch.tensor([0 if ok else 1], device=buf.device)
    dist.all_reduce(flag)
    if rank == 0:
        print(f"[smoke_dispatch] {world} ranks, backend={buf.backend_name}, device={buf.device}: "
              f"{'OK' if flag.item() == 0 else f'{flag.item()} rank(s) FAILED'}", flush=True)
    buf.destroy()
    if made_group:
        dist.destroy_process_group()
    return 0 if flag.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
