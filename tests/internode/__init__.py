"""Internode mode: topology, the hierarchical routing, the exchange round, the NVSHMEM transport,
the GPUs posing as nodes."""
