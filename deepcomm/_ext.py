"""Loading of the compiled extensions: ``deepcomm._C`` (the library) and ``deepcomm._selftest`` (test-only self-tests
of the CUDA core, used by tests/). The absence of either is a normal state, not an error."""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Dict, Optional, Tuple

_cache: Dict[str, Tuple[Optional[ModuleType], Optional[str]]] = {}


def _load(name: str) -> Tuple[Optional[ModuleType], Optional[str]]:
    """(module, None), or (None, why) when it is not built or cannot be loaded; imported once per process."""
    if name not in _cache:
        try:
            _cache[name] = (importlib.import_module(name), None)
        except (ImportError, OSError) as exc:  # OSError: a shared library it needs is missing
            _cache[name] = (None, f"{type(exc).__name__}: {exc}")
    return _cache[name]


def load_extension() -> Optional[ModuleType]:
    """Return the module ``deepcomm._C``, or ``None`` when it is not built or cannot be loaded."""
    return _load("deepcomm._C")[0]


def extension_error() -> Optional[str]:
    """Why ``load_extension()`` returned ``None`` (``None`` when the extension loaded)."""
    return _load("deepcomm._C")[1]


def load_selftest() -> Optional[ModuleType]:
    """Return the test-only module ``deepcomm._selftest`` (ptx/ host twins and GPU self-test, device queue pair
    checks, CPU-thread runs of the poster and NIC protocols), or ``None`` when it is not built or cannot be loaded
    (it needs ``deepcomm._C``)."""
    if load_extension() is None:
        return None
    return _load("deepcomm._selftest")[0]


def selftest_error() -> Optional[str]:
    """Why ``load_selftest()`` returned ``None`` (``None`` when the module loaded)."""
    if load_extension() is None:
        return f"deepcomm._C is not available ({extension_error()})"
    return _load("deepcomm._selftest")[1]
