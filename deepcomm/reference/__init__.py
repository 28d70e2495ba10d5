"""Reference backend: the API contract on torch.distributed, the oracle for the CUDA backend."""
from .backend import ReferenceBackend

__all__ = ["ReferenceBackend"]
