"""Drop-in surfaces of other EP libraries on top of deepcomm.

- ``deepcomm.compat.deep_ep``: DeepEP V1's ``Buffer``, ``Config``, ``EventOverlap`` (see its docstring for the
  differences). ``install_deep_ep()`` registers it as the module ``deep_ep`` so that unchanged code doing
  ``import deep_ep`` / ``from deep_ep import Buffer`` runs on deepcomm.
"""
from __future__ import annotations

import sys

from . import deep_ep


def install_deep_ep(force: bool = False):
    """Make ``import deep_ep`` return ``deepcomm.compat.deep_ep``. A real ``deep_ep`` already imported is left in
    place unless ``force``. Returns the module ``deep_ep`` now resolves to."""
    current = sys.modules.get("deep_ep")
    if current is None or force:
        sys.modules["deep_ep"] = deep_ep
        current = deep_ep
    return current


__all__ = ["deep_ep", "install_deep_ep"]
