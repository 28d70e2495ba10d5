"""Ranks sharing a GPU make the benchmark a correctness run only: their times are not speeds.

Several ranks on one GPU (torchrun or mpirun with more ranks than GPUs, under MPS: docs/testing.md) split its SMs
and its memory bandwidth, so nothing they measure describes the library. The benchmark finds them by comparing
the ranks' GPU identities (host and UUID, deepcomm/gpu_share.py), labels the document and every row
``shared_gpu: true``, and refuses to write any output into docs/benchmarks, where published results live.
"""
from __future__ import annotations

import os
from typing import Iterable, Optional

from deepcomm.gpu_share import most_ranks_on_one_gpu

LABEL = "shared_gpu"
HELP = ("Ranks that share a GPU (more ranks than GPUs, under MPS) are detected: every row is then labelled "
        "shared_gpu: true (correctness only, the times are not speeds) and no output may go into docs/benchmarks.")


def is_shared(identities: Iterable[str]) -> bool:
    """Some GPU in ``identities`` (one per rank) serves more than one rank."""
    return most_ranks_on_one_gpu(list(identities)) > 1


def docs_benchmarks_dir() -> str:
    """The repository's docs/benchmarks folder (where published results live)."""
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "docs", "benchmarks"))


def refused_output(paths: Iterable[Optional[str]], benchmarks_dir: Optional[str] = None) -> Optional[str]:
    """The first of ``paths`` (None entries skipped) inside ``benchmarks_dir`` (default: docs/benchmarks), or None."""
    root = os.path.realpath(benchmarks_dir or docs_benchmarks_dir())
    for path in paths:
        if path and os.path.commonpath([root, os.path.realpath(path)]) == root:
            return path
    return None


def label(doc: dict) -> dict:
    """``doc`` with the shared-GPU label on the document and on every row."""
    doc[LABEL] = True
    for row in doc.get("results", []):
        row[LABEL] = True
    return doc
