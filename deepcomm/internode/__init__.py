"""Internode backend (several nodes): ``backend.InternodeBackend``, its hierarchical NVLink + RDMA kernels,
transports (NIC, NVSHMEM) and row sizing, on the shared CUDA runtime of ``deepcomm.cuda``."""
