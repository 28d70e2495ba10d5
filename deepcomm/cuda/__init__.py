"""The CUDA runtime both CUDA backends (``deepcomm.nvlink``, ``deepcomm.internode``) build on: device error and
agreement records, wait stages, peer memory, the arena, the low-latency engine and NVSHMEM loading."""
