"""The self-tests of the CUDA core live in the test-only module deepcomm._selftest, never in deepcomm._C; without
the test-only module, `import deepcomm` and the library work and only its tests skip."""
import os
import subprocess
import sys

import pytest

from deepcomm._ext import load_extension, load_selftest, selftest_error
from tests.helpers.paths import ROOT

C = load_extension()

# Every function of deepcomm._selftest, by the module of deepcomm._C it used to sit in.
SELFTEST_TOP = ("bswap32_host", "bswap64_host", "ptx_selftest")
SELFTEST_TRANSPORT = ("qp_test_message_bytes", "qp_test_is_inline", "qp_encode_selftest", "qp_traffic",
                      "qp_traffic_on_host", "internode_test_byte", "internode_rounds_on_host")


@pytest.mark.skipif(C is None, reason="deepcomm._C is not built (no nvcc at install time)")
def test_the_library_module_exports_no_self_test():
    assert [n for n in SELFTEST_TOP if hasattr(C, n)] == []
    assert [n for n in SELFTEST_TRANSPORT if hasattr(C.transport, n)] == []
    names = dir(C) + dir(C.transport)
    assert [n for n in names if "selftest" in n or n.endswith("_on_host") or n.startswith("qp_test")] == []
    assert hasattr(C.transport, "device_qp_init") and hasattr(C.transport, "device_qp_layout")  # the library's


@pytest.mark.skipif(load_selftest() is None, reason=f"deepcomm._selftest is not available ({selftest_error()})")
def test_the_selftest_module_exports_them():
    S = load_selftest()
    assert [n for n in SELFTEST_TOP + SELFTEST_TRANSPORT if not hasattr(S, n)] == []
    assert S.qp_traffic.__doc__.startswith("qp_traffic(args: dict, keys: deepcomm._C.transport.KeyTable")


def test_without_the_selftest_module():
    # sys.modules[name] = None makes "import deepcomm._selftest" raise ImportError, as in a build without it
    code = ("import sys; sys.modules['deepcomm._selftest'] = None\n"
            "import deepcomm\n"
            "from deepcomm import _ext\n"
            "assert _ext.load_selftest() is None and _ext.selftest_error()\n"
            "assert 'reference' in deepcomm.available_backends()\n"
            "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
