"""Low-latency mode: dispatch and combine, its buffer layout, puts, run-time settings, masking ranks, its kernels."""
