"""Write (or remove) a top-level ``deep_ep`` package that hands DeepEP V1 code deepcomm's shim.

    python -m deepcomm.compat.install                 # into this interpreter's site-packages
    python -m deepcomm.compat.install --target DIR    # into DIR (put it on PYTHONPATH)
    python -m deepcomm.compat.install --remove        # take it out again

The package is one ``__init__.py`` that calls ``deepcomm.compat.install_deep_ep()``: after that ``import deep_ep``,
``deep_ep.buffer``, ``deep_ep.utils`` and ``deep_ep_cpp`` are deepcomm's modules. Nothing is written where a
``deep_ep`` that deepcomm did not write exists (a real DeepEP), and ``--remove`` removes only deepcomm's.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sysconfig
from typing import Optional

MARKER = "__deepcomm_shim__ = True"
SHIM = f'''"""deep_ep: DeepEP V1's API on deepcomm (written by `python -m deepcomm.compat.install`; undo with --remove)."""
{MARKER}
import sys as _sys

from deepcomm.compat import install_deep_ep as _install_deep_ep

_sys.modules[__name__] = _install_deep_ep(force=True)
'''


def package_dir(target: Optional[str] = None) -> str:
    return os.path.join(target or sysconfig.get_paths()["purelib"], "deep_ep")


def is_ours(path: str) -> bool:
    init = os.path.join(path, "__init__.py")
    if not os.path.isfile(init):
        return False
    with open(init, encoding="utf-8") as f:
        return MARKER in f.read()


def install(target: Optional[str] = None) -> str:
    """Writes the package; returns its directory. ``FileExistsError`` if another ``deep_ep`` is there."""
    path = package_dir(target)
    if os.path.exists(path) and not is_ours(path):
        raise FileExistsError(f"{path} exists and was not written by deepcomm (a real DeepEP?); left as is")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "__init__.py"), "w", encoding="utf-8") as f:
        f.write(SHIM)
    return path


def remove(target: Optional[str] = None) -> bool:
    """Removes deepcomm's package; returns whether there was one."""
    path = package_dir(target)
    if not is_ours(path):
        return False
    shutil.rmtree(path)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m deepcomm.compat.install", description=__doc__.splitlines()[0])
    p.add_argument("--target", help="directory to write deep_ep/ into (default: site-packages)")
    p.add_argument("--remove", action="store_true", help="remove the deep_ep package deepcomm wrote")
    args = p.parse_args(argv)
    if args.remove:
        print(f"removed {package_dir(args.target)}" if remove(args.target) else "no deepcomm deep_ep package found")
        return 0
    try:
        print(f"wrote {install(args.target)}")
    except FileExistsError as exc:
        print(exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
