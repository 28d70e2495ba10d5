"""NVLink backend (one node): ``backend.CudaBackend`` and the NVLink buffer it owns, on the shared CUDA runtime of
``deepcomm.cuda``."""
