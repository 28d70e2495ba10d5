"""The public API: Buffer arguments and validation, backend choice, settings, FP8 helpers, autograd,
torch.compile, the MoE layer, CuPy, the DeepEP compat layer."""
