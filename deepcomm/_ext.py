"""Loading of the compiled extension ``deepcomm._C``; its absence is a normal state, not an error."""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

_loaded = False
_module: Optional[ModuleType] = None
_error: Optional[str] = None


def load_extension() -> Optional[ModuleType]:
    """Return the module ``deepcomm._C``, or ``None`` when it is not built or cannot be loaded."""
    global _loaded, _module, _error
    if not _loaded:
        _loaded = True
        try:
            _module = importlib.import_module("deepcomm._C")
        except (ImportError, OSError) as exc:  # OSError: a shared library it needs is missing
            _module = None
            _error = f"{type(exc).__name__}: {exc}"
    return _module


def extension_error() -> Optional[str]:
    """Why ``load_extension()`` returned ``None`` (``None`` when the extension loaded)."""
    load_extension()
    return _error
