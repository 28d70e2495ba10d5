"""Every import of a deepcomm module names a module that exists and, for ``from X import name``, a name X defines.

Checked from the source with ``ast``, so the imports inside functions (the GPU-only paths, which import lazily and
never run on a machine without a GPU) are checked as well as the module-level ones. Covers the package itself and
the ``deepcomm.`` imports, and dotted ``"deepcomm.x.y"`` strings (monkeypatch targets), of tests/ and dev/."""
import ast
import os
from functools import lru_cache
from typing import Dict, Iterator, List, Optional, Set, Tuple

from tests.helpers.paths import ROOT

PACKAGE = "deepcomm"
# Compiled modules (setup.py builds them next to the sources; absent where the extension was not built).
EXTENSIONS = {"deepcomm._C", "deepcomm._selftest", "deepcomm._nvshmem_kernels"}


def _py_files(top: str) -> Iterator[str]:
    for base, dirs, files in os.walk(os.path.join(ROOT, top)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(base, name)


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def _modules() -> Dict[str, str]:
    """Module name -> source file, for every module of the package."""
    return {_module_name(p): p for p in _py_files(PACKAGE)}


MODULES = _modules()


def _exists(module: str) -> bool:
    return module in MODULES or module in EXTENSIONS


@lru_cache(maxsize=None)
def _tree(module: str) -> ast.Module:
    with open(MODULES[module]) as f:
        return ast.parse(f.read(), MODULES[module])


def _top_level(body: List[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, including those under module-level if / try / with blocks."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody"):
            sub = getattr(node, field, None)
            if isinstance(sub, list) and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield from _top_level(sub)
        for handler in getattr(node, "handlers", []):
            yield from _top_level(handler.body)


def _targets(target: ast.expr) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for elt in target.elts:
            yield from _targets(elt)


def _resolve(module: str, is_package: bool, level: int, name: Optional[str]) -> str:
    """The absolute module a relative import in ``module`` names."""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


@lru_cache(maxsize=None)
def _defined(module: str) -> Tuple[frozenset, bool]:
    """Names ``module`` binds at module level, and whether it takes any name (a module ``__getattr__`` or a star
    import from outside the package)."""
    names: Set[str] = set()
    open_ended = False
    is_package = MODULES[module].endswith("__init__.py")
    for node in _top_level(_tree(module).body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if node.name == "__getattr__":
                open_ended = True
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                names.update(_targets(t))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            names.update(_targets(node.target))
        elif isinstance(node, ast.Import):
            for a in node.names:
                names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name != "*":
                    names.add(a.asname or a.name)
                    continue
                source = _resolve(module, is_package, node.level, node.module) if node.level else node.module
                if source in MODULES:
                    inner, inner_open = _defined(source)
                    names.update(inner)
                    open_ended |= inner_open
                else:
                    open_ended = True
    return frozenset(names), open_ended


def _has_name(module: str, name: str) -> bool:
    if _exists(f"{module}.{name}"):
        return True
    if module in EXTENSIONS:
        return True  # compiled: its names are checked by the tests that load it
    names, open_ended = _defined(module)
    return open_ended or name in names


def _import_problems(path: str, module: Optional[str]) -> List[str]:
    """Unresolvable deepcomm imports in one file. ``module``: the file's module name inside the package, or None
    for a file outside it (only its absolute ``deepcomm.`` imports are checked)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    where = os.path.relpath(path, ROOT)
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if (a.name == PACKAGE or a.name.startswith(PACKAGE + ".")) and not _exists(a.name):
                    problems.append(f"{where}:{node.lineno}: import {a.name}: no such module")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if module is None:
                    continue  # relative import between test or dev files, not into the package
                target = _resolve(module, is_package, node.level, node.module)
            else:
                target = node.module or ""
            if not (target == PACKAGE or target.startswith(PACKAGE + ".")):
                continue
            if not _exists(target):
                problems.append(f"{where}:{node.lineno}: from {target} import ...: no such module")
                continue
            for a in node.names:
                if a.name != "*" and not _has_name(target, a.name):
                    problems.append(f"{where}:{node.lineno}: from {target} import {a.name}: {target} has no {a.name}")
    return problems


def _dotted_problems(path: str) -> List[str]:
    """``"deepcomm.x.y.attr"`` strings (monkeypatch.setattr targets, module names): the longest module prefix must
    exist and the rest must be a name it defines."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    where = os.path.relpath(path, ROOT)
    problems = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        parts = node.value.split(".")
        if parts[0] != PACKAGE or len(parts) < 2 or not all(p.isidentifier() for p in parts):
            continue
        cut = max(i for i in range(1, len(parts) + 1) if _exists(".".join(parts[:i])))
        module, rest = ".".join(parts[:cut]), parts[cut:]
        if rest and not _has_name(module, rest[0]):
            problems.append(f"{where}:{node.lineno}: {node.value!r}: {module} has no {rest[0]}")
    return problems


def test_package_imports_resolve():
    problems = [p for module, path in sorted(MODULES.items()) for p in _import_problems(path, module)]
    assert not problems, "\n".join(problems)


def test_test_and_dev_imports_resolve():
    files = [p for top in ("tests", "dev", "launch") for p in _py_files(top)]
    problems = [p for path in files for p in _import_problems(path, None) + _dotted_problems(path)]
    assert not problems, "\n".join(problems)


def test_checker_finds_a_missing_module_and_name(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from deepcomm.no_such_module import x\n    from deepcomm.buffer import no_such_name\n"
                   "    import deepcomm.nor_this\n")
    problems = _import_problems(str(bad), None)
    assert len(problems) == 3, problems
    assert "no_such_module" in problems[0] and "no_such_name" in problems[1] and "nor_this" in problems[2]
