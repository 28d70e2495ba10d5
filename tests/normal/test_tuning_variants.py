"""The compiled tuning variants of the normal-mode kernels (deepcomm._C.set_tuning: DEEPCOMM_DISPATCH_UNROLL,
DEEPCOMM_DISPATCH_PREFETCH, DEEPCOMM_DISPATCH_FUSED, DEEPCOMM_COMBINE_CONFIG) against the reference backend, bit
for bit: the intranode cases and those of many notify chunks at world size 1, one set of knobs per process (every
variant appears in one set). On the CPU: the knobs' names and values as the extension keeps them."""
import pytest

from deepcomm._ext import load_extension
from tests.helpers.nccl_run import gpu_count, run_on_gpus
from tests.normal.test_intranode import _intranode_worker, _many_chunks_worker

needs_ext = pytest.mark.skipif(load_extension() is None, reason="deepcomm._C is not built")
KNOBS = ("DEEPCOMM_DISPATCH_UNROLL", "DEEPCOMM_DISPATCH_PREFETCH", "DEEPCOMM_DISPATCH_FUSED", "DEEPCOMM_COMBINE_CONFIG")
VARIANTS = [  # (unroll, prefetch, fused, combine config): every non-default value at least once
    (16, 0, 1, 4),
    (8, 1, 0, 5),
    (16, 1, 0, 1),
    (8, 0, 1, 2),
    (8, 0, 0, 3),
    (16, 1, 1, 6),
]


def _variant_worker(rank, world, values):
    C = load_extension()
    for knob, value in zip(KNOBS, values):
        C.set_tuning(knob, value)
    assert tuple(C.get_tuning(k) for k in KNOBS) == tuple(values)
    _intranode_worker(rank, world)
    _many_chunks_worker(rank, world)


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")
@pytest.mark.parametrize("values", VARIANTS, ids=lambda v: "unroll{}-prefetch{}-fused{}-combine{}".format(*v))
def test_variant_matches_the_reference_at_world_size_1(values):
    run_on_gpus(_variant_worker, 1, values)


@needs_ext
def test_set_tuning_changes_what_get_tuning_reads_and_rejects_unknown_knobs():
    C = load_extension()
    before = {k: C.get_tuning(k) for k in KNOBS}
    try:
        for k, v in zip(KNOBS, (16, 1, 0, 5)):
            C.set_tuning(k, v)
            assert C.get_tuning(k) == v
    finally:
        for k, v in before.items():
            C.set_tuning(k, v)
    assert {k: C.get_tuning(k) for k in KNOBS} == before
    with pytest.raises(ValueError, match="NOT_A_KNOB"):
        C.set_tuning("NOT_A_KNOB", 1)
    with pytest.raises(ValueError):
        C.get_tuning("unroll")


@needs_ext
def test_notify_trace_names_match_its_point_count():
    C = load_extension()
    assert len(C.NOTIFY_TRACE_NAMES) == C.NOTIFY_TRACE_POINTS == 8
    assert C.NOTIFY_TRACE_NAMES[0] == "entry" and C.NOTIFY_TRACE_NAMES[-1] == "host counts written"
    assert C.NOTIFY_TRACE_BLOCKS == 256


@needs_ext
def test_host_stamp_names_name_every_point_of_a_dispatch_crossing():
    C = load_extension()
    assert len(C.HOST_STAMP_NAMES) == 8
    assert C.HOST_STAMP_NAMES[0] == "entry" and C.HOST_STAMP_NAMES[-1] == "tuple built"
