"""Constants the extension exports instead of Python copying them from C++: every WaitStage, LlPhases and the top-k
limit, as the headers define them; the text of every wait stage; and the one Python copy, validation.MAX_TOPK (the
reference backend checks top-k without the extension), equal to the export."""
import os
import re

import pytest

from deepcomm._ext import load_extension

from tests.helpers.paths import ROOT

C = load_extension()
pytestmark = pytest.mark.skipif(C is None, reason="deepcomm._C is not built (no nvcc at install time)")


def _header(*path: str) -> str:
    with open(os.path.join(ROOT, "csrc", *path)) as f:
        return f.read()


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


def test_wait_stages_are_the_enum():
    """WAIT_STAGES holds every enumerator of enum WaitStage but kStageNone, under its name in snake case."""
    enum = dict(re.findall(r"^\s*kStage(\w+)\s*=\s*(\d+),", _header("runtime", "error_record.cuh"), re.M))
    assert len(set(enum.values())) == len(enum), enum  # no number given twice
    want = {_snake(name): int(num) for name, num in enum.items() if name != "None"}
    assert C.WAIT_STAGES == want
    T = C.transport
    for name in ("nvshmem_credit", "nvshmem_signal", "node_barrier", "hier_free", "hier_arrive", "hier_local"):
        assert C.WAIT_STAGES[name] == getattr(T, "STAGE_" + name.upper()), name


def test_every_stage_has_one_text():
    """Each exported stage is a timeout with a name or an input error with a message, never both; the texts name
    no stage the extension lacks; input errors are the numbers from 100 (error_record.cuh)."""
    from deepcomm.cuda.wait_stages import INPUT_ERROR_TEXT, STAGE_TEXT, input_error_text, stage_text
    assert not set(STAGE_TEXT) & set(INPUT_ERROR_TEXT)
    assert set(STAGE_TEXT) | set(INPUT_ERROR_TEXT) == set(C.WAIT_STAGES)
    for name, number in C.WAIT_STAGES.items():
        if name in INPUT_ERROR_TEXT:
            assert number >= 100 and input_error_text(C, number) == INPUT_ERROR_TEXT[name]
        else:
            assert 0 < number < 100 and input_error_text(C, number) is None
            assert stage_text(C, number) == STAGE_TEXT[name]
    assert stage_text(C, C.WAIT_STAGES["node_barrier"]).startswith("node:barrier ")
    assert stage_text(C, 99) == "stage 99"


def test_ll_phases_are_the_enum():
    enum = dict(re.findall(r"kLl(\w+?)Phases?\s*=\s*(\d+)", _header("kernels", "ll_phases.hpp")))
    assert C.LL_PHASES == {name.lower(): int(num) for name, num in enum.items()}
    assert set(C.LL_PHASES) == {"send", "recv", "both", "weights"}
    assert C.LL_PHASES["both"] == C.LL_PHASES["send"] | C.LL_PHASES["recv"]


def test_ll_trace_points_are_the_enum():
    text = _header("kernels", "ll_trace_points.hpp")
    points = [int(n) for n in re.findall(r"^\s*kLlTrace\w+\s*=\s*(\d+),", text, re.M)]
    assert C.LL_TRACE_POINTS == int(re.search(r"kLlTracePoints\s*=\s*(\d+);", text).group(1))
    assert sorted(points) == list(range(C.LL_TRACE_POINTS))


def test_topk_limit_is_exported_once():
    from deepcomm import validation
    assert C.TOPK_MAX == int(re.search(r"kTopkMax\s*=\s*(\d+);", _header("kernels", "topk_max.hpp")).group(1))
    assert validation.MAX_TOPK == C.TOPK_MAX


def test_internode_limits_are_the_header_s():
    """The internode limits come from csrc/runtime/internode_limits.hpp, and Python keeps no copy of them."""
    text = _header("runtime", "internode_limits.hpp")
    ranks = int(re.search(r"kInternodeMaxRanks = (\d+);", text).group(1))
    nodes = int(re.search(r"kInternodeMaxNodes = (\d+);", text).group(1))
    T = C.transport
    assert (T.INTERNODE_MAX_RANKS, T.INTERNODE_MAX_NODES) == (ranks, nodes) == (256, 32)
    assert T.KEY_TABLE_REGIONS == T.HIER_MAX_NODES == nodes  # our region and one per rail peer; a lane per node
    assert ranks // nodes == 8 <= T.MAX_NODE_GPUS
    keys = T.KeyTable()
    for i in range(T.KEY_TABLE_REGIONS):
        keys.add(i, 4096 * i, 4096, 4096 * i)
    with pytest.raises(ValueError, match=f"at most {nodes} regions"):
        keys.add(99, 0, 16, 0)
    from deepcomm.internode.internode_size import internode_size_problem
    assert internode_size_problem(T, 256, 8) is None and internode_size_problem(T, 32, 1) is None
    assert "at most 256 ranks" in internode_size_problem(T, 264, 8)
    assert "at most 32 nodes" in internode_size_problem(T, 64, 1)
    for root, _, files in os.walk(os.path.join(ROOT, "deepcomm")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(root, name)) as f:
                    assert not re.search(r"MAX_RANKS\s*=\s*\d", f.read()), name
