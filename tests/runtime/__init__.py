"""Below the backends: ptx/ helpers, sizing and device memory, extension constants, WQE encoding and device
queue pairs, NVSHMEM loading."""
