"""deepcomm.bench: the benchmark harness (protocol: docs/benchmarks/README.md).

Run ``python -m deepcomm.bench --help`` (console script ``deepcomm-bench``). The harness times deepcomm
and its peers (raw all-to-all of the same bytes, and a plain torch.distributed MoE layer) with one timer
in one run, and writes a table, JSON (the docs/benchmarks format), CSV and optional PNG plots.

Modules, one job each:
    cli        argument parsing, process launch (torchrun / self-spawn), the run loop
    workloads  seeded random routing and inputs
    timing     CUDA-event / perf_counter timing, slowest-rank reduction
    peers      the systems under test: all-to-all, MoE layer, deepcomm
    metrics    logical byte counts and GB/s
    report     table, JSON, CSV, machine description, progress bar
    plots      PNG plots (only when matplotlib is importable)
"""
