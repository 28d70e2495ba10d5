"""Drop-in surfaces of other EP libraries on top of deepcomm.

- ``deepcomm.compat.deep_ep``: DeepEP V1's package (``Buffer``, ``Config``, ``EventOverlap``, ``topk_idx_t``,
  ``deep_ep.buffer``, ``deep_ep.utils``). ``install_deep_ep()`` registers it as ``deep_ep`` so that unchanged
  code doing ``import deep_ep`` / ``from deep_ep.utils import EventOverlap`` runs on deepcomm;
  ``python -m deepcomm.compat.install`` writes a tiny ``deep_ep`` package that does the same when imported.
"""
from __future__ import annotations

import sys

from . import deep_ep

# DeepEP's module names -> this package's modules
MODULES = {"deep_ep": deep_ep, "deep_ep.buffer": deep_ep.buffer, "deep_ep.utils": deep_ep.utils,
           "deep_ep_cpp": deep_ep._cpp}


def install_deep_ep(force: bool = False):
    """Make ``import deep_ep`` (and ``deep_ep.buffer``, ``deep_ep.utils``, ``deep_ep_cpp``) return deepcomm's
    DeepEP V1 modules. A real ``deep_ep`` already imported is left in place unless ``force``. Returns the module
    ``deep_ep`` now resolves to."""
    current = sys.modules.get("deep_ep")
    if current is not None and current is not deep_ep and not force \
            and not getattr(current, "__deepcomm_shim__", False):
        return current
    sys.modules.update(MODULES)
    return deep_ep


__all__ = ["MODULES", "deep_ep", "install_deep_ep"]
