"""deepcomm: expert-parallel communication (dispatch / combine) for Mixture-of-Experts models.

Importing never needs a GPU or the compiled extension: the reference backend is always available.
"""
from . import fp8, moe, ops
from ._version import __version__
from .backends import available_backends
from .buffer import Buffer
from .config import Config, default_num_sms
from .errors import CommTimeoutError
from .handle import Handle, LowLatencyHandle
from .moe import MoELayer

__all__ = [
    "Buffer",
    "Config",
    "CommTimeoutError",
    "Handle",
    "LowLatencyHandle",
    "MoELayer",
    "available_backends",
    "default_num_sms",
    "fp8",
    "moe",
    "ops",
]
