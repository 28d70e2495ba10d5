"""Stand-ins for the CUDA side of the internode kernels' calls (deepcomm/internode/hier_kernels.py), so that their
host path runs on a CPU box with the ranks as threads (tests/helpers/threaded_world.py): the count round over the
threads' rail and node stand-ins, the launch plans and output allocations, and a recorded launch in place of the
kernels (whose outputs therefore stay unwritten). dev/count_host_ops.py counts the torch operators of each call."""
from __future__ import annotations

import contextlib
import types

import torch

from deepcomm.internode import hier_kernels
from deepcomm.internode.deferred_agree import DeferredAgreement
from deepcomm.internode.hier_comm import HierComm
from deepcomm.internode.internode_rows import max_node_row_bytes, rail_slot_bytes
from tests.helpers.threaded_world import NodeArea, RailTransport, World


class QueuedRail(RailTransport):
    """A RailTransport that takes the kernels' queued rounds (``wait=False``) and has an empty error record."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.waits = []

    def exchange(self, send_bytes, send_begin, wait=True):
        self.waits.append(wait)
        super().exchange(send_bytes, send_begin)

    def check_error(self):
        pass


class QuietArea(NodeArea):
    """A NodeArea with an empty error record and the area size the kernels' checks read."""

    def __init__(self, world, rank, area_bytes):
        super().__init__(world, rank)
        self.area_bytes = area_bytes

    def check_error(self):
        pass


def world_for(nodes: int, gpus: int, max_tokens: int, hidden: int) -> World:
    R = nodes * gpus
    return World(R, gpus, area_bytes=R * max_tokens * max_node_row_bytes(hidden), timeout_s=120.0)


def kernels_on_threads(world: World, rank: int, nodes: int, gpus: int, max_tokens: int, hidden: int):
    """The ``k`` (HierKernels' interface) of thread ``rank``: its HierComm over the threads, deferred agreement,
    the real size checks, and launches recorded in ``k.launches`` instead of run. Call inside ``no_device()``."""
    R = nodes * gpus
    tr = QueuedRail(world, rank, rail_slot_bytes(max_tokens, hidden), [m * gpus + rank % gpus for m in range(nodes)])
    tr.timeout_s = 120.0
    link = QuietArea(world, rank, R * max_tokens * max_node_row_bytes(hidden))
    comm = HierComm(tr, link, rank, R, gpus, torch.device("cpu"))
    k = types.SimpleNamespace(comm=comm, tr=tr, link=link, agreement=DeferredAgreement(), launches=[])
    k.begin_call = lambda: None
    k.end_call = lambda stream: None
    k.words_in_strip = lambda fingerprint: False
    k.header_bytes = lambda words, combine: hier_kernels.RAIL_HEADER_BYTES
    k.check_fits = lambda *a, **kw: hier_kernels.HierKernels.check_fits(k, *a, **kw)
    k.dispatch_launch = lambda **fields: ("dispatch", fields)
    k.combine_launch = lambda **fields: ("combine", fields)
    k._launch = lambda kernel, launch, fingerprint=None: k.launches.append((kernel, launch))
    return k


@contextlib.contextmanager
def no_device():
    """The calls enter ``torch.cuda.device(dev)`` around their launch: a no-op for the CPU stand-ins."""
    saved = torch.cuda.device
    torch.cuda.device = lambda device: contextlib.nullcontext()
    try:
        yield
    finally:
        torch.cuda.device = saved
