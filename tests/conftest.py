"""Pytest set-up: the `gpu` marker (skipped without CUDA) and the repository root on sys.path."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped when torch.cuda is unavailable)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With DEEPCOMM_TEST_FAILURES_AT_ONCE set, a failure's traceback is printed when it happens, not at the end:
    a run cut short by a time limit still says what failed."""
    if report.failed and os.environ.get("DEEPCOMM_TEST_FAILURES_AT_ONCE"):
        sys.stderr.write(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
        sys.stderr.flush()
