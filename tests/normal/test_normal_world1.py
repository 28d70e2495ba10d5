"""Normal mode at world size 1 (one GPU, one rank): the fresh, cached, worst-case-size and bounce paths of the
NVLink kernels against the reference backend, bit for bit. Every row is local, so this runs wherever one GPU is."""
import pytest

from tests.helpers.nccl_run import gpu_count, run_on_gpus
from tests.normal.test_graph_async import _worker as graph_async_worker
from tests.normal.test_intranode import _intranode_worker, _many_chunks_worker

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")]


def test_intranode_cases_at_world_size_1():
    run_on_gpus(_intranode_worker, 1)


def test_worst_case_graph_and_async_at_world_size_1():
    run_on_gpus(graph_async_worker, 1)


def test_many_notify_chunks_at_world_size_1():
    run_on_gpus(_many_chunks_worker, 1)
