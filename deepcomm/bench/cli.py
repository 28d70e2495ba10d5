"""`python -m deepcomm.bench` / `deepcomm-bench`: the benchmark workloads against every peer (the protocol:
docs/benchmarks/README.md).

Launch:
- under torchrun (RANK/WORLD_SIZE/LOCAL_RANK set): one process per rank, NCCL on GPUs, gloo on CPU;
- otherwise with GPUs: spawns one process per visible GPU (or --world-size) with NCCL;
- otherwise (or --device cpu): spawns --world-size CPU processes (default 2) with gloo; deepcomm then runs
  on its reference backend.
Rank 0 prints the table and writes --json / --csv / --plots.
"""
from __future__ import annotations

import argparse
import sys
import os

from deepcomm.bench import shared_gpu
from deepcomm.local_launch import device_type, init_rank, launch

GPU_TOKENS = [128, 512, 1024, 2048, 4096, 8192]
CPU_TOKENS = [128, 512]
GPU_NUM_SMS = [4, 8, 16, 24, 32]
GPU_LL_TOKENS = [1, 32, 128, 256]
SYSTEMS = ["deepcomm", "a2a", "moe-layer", "deepep"]


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _choice_list(choices):
    def parse(text: str) -> list[str]:
        vals = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in vals if v not in choices]
        if bad or not vals:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {choices}, got {text!r}")
        return vals
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepcomm-bench",
        description="Benchmark deepcomm dispatch/combine against raw all-to-all and a plain MoE layer, "
                    "timed by the same harness in the same run (protocol: docs/benchmarks/README.md). "
                    "Defaults: GPU = the full workload; CPU = a short run on the reference backend, whose "
                    "timings measure the pure-PyTorch oracle, not the CUDA kernels.",
        epilog=shared_gpu.HELP)
    p.add_argument("--tokens", type=_int_list, default=None,
                   help="tokens per rank, normal mode (default GPU 128,512,1024,2048,4096,8192; CPU 128,512)")
    p.add_argument("--ll-tokens", type=_int_list, default=None,
                   help="tokens per rank, low-latency mode (default GPU 1,32,128,256; CPU 128); the largest is "
                        "the Buffer's num_max_low_latency_tokens, which sizes its low-latency buffer")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 7168; 1024 with --quick on CPU)")
    p.add_argument("--topk", type=int, default=8, help="experts per token (default 8)")
    p.add_argument("--experts", type=int, default=256,
                   help="experts in all, a multiple of the world size (default 256)")
    p.add_argument("--num-sms", type=_int_list, default=None,
                   help="num_sms sweep for deepcomm's CUDA backend (default 4,8,16,24,32; none on reference)")
    p.add_argument("--sweep-tokens", type=int, default=4096,
                   help="tokens at which num_sms is swept (default 4096, else the largest --tokens)")
    p.add_argument("--modes", type=_choice_list(["normal", "low_latency", "internode"]),
                   default=["normal", "low_latency"],
                   help="comma-separated: normal, low_latency (default both); or internode alone: normal-mode "
                        "workloads on a topology of several nodes (--gpus-per-node), reported as mode "
                        "internode-emulated (GPU-posted WQEs executed by the device emulated NIC), or "
                        "internode-nvshmem with DEEPCOMM_INTERNODE_TRANSPORT=nvshmem")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="topology of deepcomm's Buffer (default: DEEPCOMM_GPUS_PER_NODE, else LOCAL_WORLD_SIZE, "
                        "else one node); --modes internode needs fewer GPUs per node than ranks")
    p.add_argument("--dtypes", type=_choice_list(["fp8", "bf16"]), default=["fp8", "bf16"],
                   help="comma-separated: fp8, bf16 (default both): the dtype of dispatch and of combine, in "
                        "both modes (an fp8 combine is combine(..., use_fp8=True) on bf16 expert outputs, "
                        "reported with its error against the BF16 combine)")
    p.add_argument("--ops", type=_choice_list(["dispatch", "combine"]), default=["dispatch", "combine"],
                   help="comma-separated: dispatch, combine (default both)")
    p.add_argument("--systems", type=_choice_list(SYSTEMS), default=list(SYSTEMS),
                   help="a2a = all_to_all_single of the same bytes; moe-layer = count exchange + permute + "
                        "all-to-all + un-permute with torch.distributed; deepep = DeepEP V1 when `import deep_ep` "
                        "finds it (GPUs, NCCL; skipped with a note otherwise)")
    p.add_argument("--world-size", type=int, default=None,
                   help="processes to spawn when not under torchrun (CPU default 2, GPU default all visible)")
    p.add_argument("--backend", choices=["auto", "cuda", "reference"], default="auto", help="deepcomm backend")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="where tensors live (auto: cuda when a GPU is visible)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls (default 20 on GPU, 5 on CPU)")
    p.add_argument("--iters", type=int, default=None, help="timed calls (default 50 on GPU, 20 on CPU)")
    p.add_argument("--seed", type=int, default=0, help="routing and data seed (mixed with the rank)")
    p.add_argument("--quick", action="store_true",
                   help="short run: GPU 4096 tokens and num_sms 8,24; CPU hidden 1024, 2 warm-up + 5 timed calls")
    p.add_argument("--check", action="store_true",
                   help="before timing, check deepcomm's BF16 dispatch/combine against the MoE layer's")
    p.add_argument("--json", metavar="PATH", help="write the result file (docs/benchmarks format)")
    p.add_argument("--csv", metavar="PATH", help="write the results as CSV")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots there (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def resolve_defaults(args: argparse.Namespace, device_type: str) -> argparse.Namespace:
    gpu = device_type == "cuda"
    if args.tokens is None:
        args.tokens = [4096] if (gpu and args.quick) else (GPU_TOKENS if gpu else CPU_TOKENS)
    if args.hidden is None:
        args.hidden = 1024 if (args.quick and not gpu) else 7168
    if args.warmup is None:
        args.warmup = 20 if gpu else (2 if args.quick else 5)
    if args.iters is None:
        args.iters = 50 if gpu else (5 if args.quick else 20)
    if args.ll_tokens is None:
        args.ll_tokens = [128] if (args.quick or not gpu) else GPU_LL_TOKENS
    if args.num_sms is None and gpu:
        args.num_sms = [8, 24] if args.quick else GPU_NUM_SMS
    if args.sweep_tokens not in args.tokens:
        args.sweep_tokens = max(args.tokens)
    if min(args.ll_tokens) <= 0:
        raise SystemExit("--ll-tokens: must be positive")
    for name in ("hidden", "topk", "experts", "iters"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')}: must be positive")
    if args.warmup < 0:
        raise SystemExit("--warmup: must be >= 0")
    if "internode" in args.modes:
        if len(args.modes) > 1:
            raise SystemExit("--modes: internode runs alone (its Buffer has a multi-node topology)")
        if not gpu:
            raise SystemExit("--modes internode: needs --device cuda (the emulated NIC runs on GPUs)")
    if args.gpus_per_node is not None and args.gpus_per_node <= 0:
        raise SystemExit("--gpus-per-node: must be positive")
    if "fp8" in args.dtypes and args.hidden % 128:
        raise SystemExit(f"--hidden: FP8 needs a multiple of 128, got {args.hidden}")
    return args


# ---------------------------------------------------------------------------------------------- worker

def _make_cases(args, systems, dc):
    from deepcomm.bench.peers import Case

    def op_dtypes():
        pairs = [("dispatch", d) for d in args.dtypes if "dispatch" in args.ops]
        if "combine" in args.ops:
            pairs += [("combine", d) for d in args.dtypes]
        return pairs

    cases = []
    for mode in args.modes:
        token_list = args.ll_tokens if mode == "low_latency" else args.tokens
        for T in token_list:
            for sys_ in systems:
                cases += [Case(sys_.name, mode, op, dt, T) for op, dt in op_dtypes()
                          if sys_.supports(mode, op, dt)]
            sweeping = [s for s in systems if getattr(s, "uses_sms", False)]  # deepcomm's kernels, DeepEP
            if mode == "normal" and args.num_sms and T == args.sweep_tokens:
                cases += [Case(s.name, mode, op, dt, T, n) for s in sweeping for n in args.num_sms
                          for op, dt in op_dtypes() if s.supports(mode, op, dt)]
            if mode == "low_latency" and dc is not None:
                # the decoding step (dispatch + combine), and on GPUs the kernels' own time through CUDA graphs
                both = [("dispatch+combine", d) for d in args.dtypes] if len(args.ops) == 2 else []
                cases += [Case(dc.name, mode, op, dt, T) for op, dt in both]
                if dc.uses_sms:
                    cases += [Case(dc.name, mode, op, dt, T, timing="cuda-graph")
                              for op, dt in op_dtypes() + both if dc.supports(mode, op, dt)]
            if mode == "low_latency":
                cases += [Case(s.name, mode, op, dt, T, timing="cuda-graph") for s in systems
                          if s is not dc and getattr(s, "graph_timing", False)
                          for op, dt in op_dtypes() if s.supports(mode, op, dt)]
    return cases


def _fp8_errors(dc, case, inp, device) -> dict:
    """The FP8 combine's error against the BF16 combine over every rank's output (run outside the timing)."""
    import torch
    import torch.distributed as dist

    max_rel, err_sum, ref_sum = dc.fp8_combine_errors(case, inp)
    worst = torch.tensor([max_rel], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    sums = torch.tensor([err_sum, ref_sum], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    err, ref = sums.tolist()
    return {"max_rel_err": float(f"{float(worst[0]):.4g}"), "mean_rel_err": float(f"{err / ref if ref else 0.0:.4g}")}


def _deepep_peer(args, ctx, dc, rank):
    """DeepEP V1 as a peer where every rank imports the real deep_ep on a GPU over NCCL, else None (rank 0 says
    why; every rank decides alike, so none runs DeepEP's collectives alone)."""
    import torch.distributed as dist

    from deepcomm.bench.deepep_peer import DeepEP, find_deep_ep

    module, why = find_deep_ep()
    if ctx.device.type != "cuda" or ctx.dist_backend != "nccl":
        module, why = None, "DeepEP needs GPUs and an NCCL group"
    found = [None] * ctx.world_size
    dist.all_gather_object(found, module is not None, group=ctx.group)
    if not all(found):
        if rank == 0:
            print(f"deepep-v1 skipped: {why or 'not importable on every rank'}")
        return None
    default_sms = dc.default_num_sms if dc is not None and dc.default_num_sms else 24
    return DeepEP(ctx, module, max(args.tokens), max(args.ll_tokens), default_sms)


def run_worker(rank: int, world_size: int, local_rank: int, args, device_type: str) -> int:
    import torch
    import torch.distributed as dist

    from deepcomm.bench import metrics, peers, report, timing
    from deepcomm.bench.workloads import Workload, make_inputs
    from deepcomm.gpu_share import gather_gpu_identities

    device = init_rank(rank, world_size, local_rank, device_type)
    dist_backend = str(dist.get_backend()).lower()
    shared = device_type == "cuda" and shared_gpu.is_shared(gather_gpu_identities(dist.group.WORLD, device))
    refused = shared_gpu.refused_output([args.json, args.csv, args.plots]) if shared else None
    if refused:  # the same answer on every rank: all leave before any collective of the benchmark
        raise SystemExit(f"{refused}: ranks share a GPU here; their times are not speeds and stay out of "
                         "docs/benchmarks")
    ctx = peers.Context(rank=rank, world_size=world_size, device=device, group=dist.group.WORLD,
                        dist_backend=dist_backend, hidden=args.hidden, topk=args.topk, experts=args.experts)
    if args.experts % world_size:
        raise SystemExit(f"--experts: {args.experts} is not a multiple of the world size {world_size}")

    systems, dc = [], None
    if "deepcomm" in args.systems:
        # ranks sharing a GPU are joined by gloo, where "auto" would pick the reference backend (docs/api.md)
        backend = "cuda" if shared and args.backend == "auto" else args.backend
        dc = peers.Deepcomm(ctx, max_tokens=max(args.tokens), ll_tokens=max(args.ll_tokens), backend=backend,
                            gpus_per_node=args.gpus_per_node)
        if "internode" in args.modes and not dc.is_internode:
            raise SystemExit("--modes internode: the Buffer's topology has one node; pass --gpus-per-node (e.g. 1 "
                             "on 2 GPUs: 2 nodes x 1 GPU) or set DEEPCOMM_GPUS_PER_NODE")
        if "internode" not in args.modes and dc.is_internode:
            raise SystemExit("--modes: the Buffer's topology has several nodes; use --modes internode")
        systems.append(dc)
    if "a2a" in args.systems:
        systems.append(peers.AllToAll(ctx))
    if "moe-layer" in args.systems:
        systems.append(peers.MoELayer(ctx))
    deepep = _deepep_peer(args, ctx, dc, rank) if "deepep" in args.systems else None
    if deepep is not None:
        systems.append(deepep)
    by_name = {s.name: s for s in systems}

    cases = _make_cases(args, systems, dc)
    progress = report.Progress(len(cases), enabled=rank == 0 and not args.no_progress)
    inputs_cache, results = {}, []
    for case in cases:
        if case.tokens not in inputs_cache:
            inputs_cache.clear()
            wl = Workload(case.tokens, args.hidden, args.topk, args.experts, args.seed)
            inputs_cache[case.tokens] = inp = make_inputs(wl, rank, world_size, device)
            if args.check and dc is not None:
                peers.check_against_moe_layer(dc, peers.MoELayer(ctx), inp)
        inp = inputs_cache[case.tokens]
        fn = by_name[case.system].prepare(case, inp)
        t = timing.bench(fn, args.warmup, args.iters, device)
        calls = getattr(fn, "calls", 1)  # a graph of several calls: time per call
        t = timing.Timing(mean_us=t.mean_us / calls, median_us=t.median_us / calls, host_us=t.host_us / calls)
        del fn
        # a dispatch+combine step is reported by time only; its bytes are counted as the dispatch's
        nbytes = metrics.logical_bytes(inp.num_recv_rows(rank), args.hidden, case.op.split("+")[0], case.dtype)
        mean_us, median_us, neg_gbps = timing.slowest_rank(
            [t.mean_us, t.median_us, -metrics.gbps(nbytes, t.mean_us)], device)
        results.append({"system": case.system, "mode": peers.reported_mode(case, dc), "op": case.op,
                        "dtype": case.dtype,
                        "tokens": case.tokens, "hidden": args.hidden, "topk": args.topk,
                        "experts": args.experts, "num_sms": by_name[case.system].reported_num_sms(case),
                        "time_us": round(mean_us, 2), "median_us": round(median_us, 2),
                        "host_us": round(t.host_us, 2),
                        "gbps": round(-neg_gbps, 2) if "+" not in case.op else None, "timing": case.timing})
        if case.system == "deepcomm" and case.op == "combine" and case.dtype == "fp8":
            results[-1].update(_fp8_errors(dc, case, inp, device))
        progress.step(case.label())
        if device_type == "cuda":
            torch.cuda.empty_cache()

    overlap = None
    if dc is not None and dc.uses_sms and "low_latency" in args.modes:
        wl = Workload(128, args.hidden, args.topk, args.experts, args.seed)
        overlap = dc.hook_overlap(make_inputs(wl, rank, world_size, device), args.dtypes[0])
    if rank == 0:
        doc = report.make_document(results, device_type, world_size, dc.backend_name if dc else None)
        if shared:
            shared_gpu.label(doc)
            print("shared GPU: several ranks on one GPU; correctness only, the times below are not speeds")
        if overlap is not None:
            doc["hook_overlap"] = dict(overlap, tokens=128, dtype=args.dtypes[0], matmul="8192x8192 bf16")
        report.print_report(doc)
        if args.json:
            report.write_json(doc, args.json)
            print(f"wrote {args.json}")
        if args.csv:
            report.write_csv(doc["results"], args.csv)
            print(f"wrote {args.csv}")
        if args.plots:
            from deepcomm.bench.plots import write_plots

            written = write_plots(doc, args.plots)
            print("wrote " + ", ".join(written) if written else "plots skipped (matplotlib not importable)")
    if dc is not None:
        dc.close()
    if deepep is not None:
        deepep.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    dev_type = device_type(args.device)
    args = resolve_defaults(args, dev_type)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:      # started by torchrun: launch runs in place
        return launch(run_worker, args, dev_type, int(os.environ["WORLD_SIZE"]), "deepcomm-bench")

    import torch

    if dev_type == "cuda":
        gpus = torch.cuda.device_count()
        world = args.world_size or gpus
        if world > gpus:
            raise SystemExit(f"--world-size: {world} processes but only {gpus} GPUs are visible")
    else:
        world = args.world_size or 2
    if world < 1:
        raise SystemExit("--world-size: must be >= 1")
    if args.experts % world:
        raise SystemExit(f"--experts: {args.experts} is not a multiple of the world size {world}")
    return launch(run_worker, args, dev_type, world, "deepcomm-bench")


if __name__ == "__main__":
    sys.exit(main())
