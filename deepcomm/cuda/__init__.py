"""CUDA backend: NVLink kernels from the extension ``deepcomm._C`` behind the same contract as the reference."""
