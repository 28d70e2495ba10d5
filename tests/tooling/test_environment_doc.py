"""docs/environment.md lists every DEEPCOMM_* variable the code reads, and nothing the code does not read.

The code: Python and shell files of the package, the launch and dev scripts, setup.py, CI, examples and tests; in C/C++
the names passed to getenv. A name right after a letter (a `-DDEEPCOMM_...` compile definition) is not a read."""
import os
import re

from tests.helpers.paths import ROOT

DOC = os.path.join(ROOT, "docs", "environment.md")
NAME = re.compile(r"(?<![A-Za-z0-9_])DEEPCOMM_[A-Z0-9_]*[A-Z0-9]")
GETENV = re.compile(r"getenv\(\s*\"(DEEPCOMM_[A-Z0-9_]+)\"")
SCRIPT_SUFFIXES = (".py", ".sh", ".sbatch")


def _files():
    for top in ("deepcomm", "launch", "dev", "tests", "examples", ".ci", "csrc"):
        for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
            for name in names:
                yield os.path.join(dirpath, name)
    yield os.path.join(ROOT, "setup.py")


def names_in_code():
    found = {}
    for path in _files():
        is_script = path.endswith(SCRIPT_SUFFIXES) or os.path.dirname(path).endswith(".ci")
        is_native = path.endswith((".cpp", ".cu", ".h", ".hpp", ".cuh"))
        if not (is_script or is_native) or os.path.samefile(path, __file__):
            continue
        with open(path, errors="replace") as f:
            text = f.read()
        for name in (NAME.findall(text) if is_script else GETENV.findall(text)):
            found.setdefault(name, os.path.relpath(path, ROOT))
    return found


def names_in_table():
    names = set()
    with open(DOC) as f:
        for line in f:
            if line.startswith("| `"):
                first_cell = line.split("|")[1]
                names.update(re.findall(r"`([A-Z][A-Z0-9_]*)`", first_cell))
    return names


def test_every_variable_read_is_in_the_table():
    table = names_in_table()
    missing = {name: path for name, path in names_in_code().items() if name not in table}
    assert not missing, f"read by the code but not in docs/environment.md: {missing}"


def test_the_table_names_only_variables_the_code_reads():
    code = names_in_code()
    stale = sorted(n for n in names_in_table() if n.startswith("DEEPCOMM_") and n not in code)
    assert not stale, f"in docs/environment.md but read nowhere: {stale}"


def test_the_scan_finds_reads_in_each_kind_of_file():
    code = names_in_code()
    assert code["DEEPCOMM_COMBINE_CONFIG"].startswith("csrc/") or "DEEPCOMM_COMBINE_CONFIG" in code
    for name in ("DEEPCOMM_LOG", "DEEPCOMM_CPU_PROCS", "DEEPCOMM_NO_CUDA", "DEEPCOMM_TEST_WORLD"):
        assert name in code, name
    assert "DEEPCOMM_WITH_NVSHMEM" not in code  # a compile definition
