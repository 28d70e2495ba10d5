"""What the tests share: process runners (CPU: multiproc; GPU: nccl_run, fault_run), brute-force oracles,
bit-for-bit comparison, the thread-per-rank world, the internode GPU cases and the repository root (paths)."""
