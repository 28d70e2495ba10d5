"""Normal mode: dispatch layout, dispatch and combine (fresh, cached, worst-case size, route-only, FP8 combine),
the CUDA backend's host path, the NVLink kernels."""
