"""DeepEP V1's package ``deep_ep`` on top of deepcomm: ``Buffer``, ``Config``, ``EventOverlap``, ``topk_idx_t`` and
the submodules ``deep_ep.buffer`` and ``deep_ep.utils``, with DeepEP's names, arguments and return values.

``deepcomm.compat.install_deep_ep()`` makes ``import deep_ep`` (and ``deep_ep.buffer``, ``deep_ep.utils``,
``deep_ep_cpp``) resolve here; ``python -m deepcomm.compat.install`` writes a ``deep_ep`` package that does it on
import. A name DeepEP has and this package does not raises AttributeError / ImportError naming it. Differences
from DeepEP: docs/api.md, "DeepEP V1 drop-in".
"""
import torch  # noqa: F401  (DeepEP's package imports torch too)

from . import buffer, utils
from ._cpp import Config, topk_idx_t
from .buffer import Buffer
from .utils import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "buffer", "topk_idx_t", "utils"]


def __getattr__(name: str):
    raise AttributeError(f"module 'deep_ep' (deepcomm's DeepEP V1 shim) has no attribute {name!r}")
