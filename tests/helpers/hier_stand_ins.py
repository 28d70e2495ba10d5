"""Stand-ins for the CUDA side of the internode kernels' calls (deepcomm/internode/hier_kernels.py), so that their
host path runs on a CPU box with the ranks as threads (tests/helpers/threaded_world.py): a HierKernels over the
threads' rail and node stand-ins whose transport module records each typed launch instead of running it (the
kernels' outputs therefore stay unwritten), and torch.cuda's stream, event and device calls made harmless.
tests/internode/test_hier_launch_args.py and tests/agreement/test_agree_kernels_host.py check what the calls build;
dev/count_host_ops.py counts their torch operators."""
from __future__ import annotations

import types

import torch

from deepcomm._ext import load_extension
from tests.helpers.threaded_world import NodeArea, RailTransport


class QueuedRail(RailTransport):
    """A RailTransport that takes the kernels' queued rounds (``wait=False``, recorded in ``waits``) and has an
    empty error record."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.waits = []

    def exchange(self, send_bytes, send_begin, wait=True):
        self.waits.append(wait)
        super().exchange(send_bytes, send_begin)

    def check_error(self):
        pass

    def refuse_if_broken(self):
        pass


class RecordedArea(NodeArea):
    """A NodeArea with the pointers and epochs a launch names (made up: nothing reads them) and an empty error
    record."""
    broken, epoch = False, 0

    def area_ptrs(self):
        return [0x1000 * (g + 1) for g in range(self.gpus)]

    def word_ptrs(self, name):
        return [0x100 * (g + 1) + (8 if name == "free" else 16) for g in range(self.gpus)]

    def next_epoch(self):
        self.epoch += 1
        return self.epoch

    def check_error(self):
        pass


def recording_world(setattr_) -> None:
    """torch.cuda's stream and event calls made harmless on the CPU (the launcher only orders and records), through
    ``setattr_`` (monkeypatch.setattr, or any (obj, name, value) setter that undoes itself)."""
    stream = types.SimpleNamespace(cuda_stream=5, wait_stream=lambda s: None)
    setattr_(torch.cuda, "current_stream", lambda device=None: stream)
    setattr_(torch.cuda, "Event", lambda: types.SimpleNamespace(record=lambda s=None: None))

    class _Device:
        def __init__(self, device):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    setattr_(torch.cuda, "device", _Device)


def recording_kernels(world, rank: int, launches: list, max_tokens: int, hidden: int):
    """A HierKernels over the threaded ``world`` for up to ``max_tokens`` tokens of ``hidden``, whose transport
    module records each launch in ``launches`` as ``(kind, typed launch)`` instead of running it."""
    from deepcomm.internode.deferred_agree import DeferredAgreement
    from deepcomm.internode.hier_comm import HierComm
    from deepcomm.internode.hier_kernels import HierKernels
    from deepcomm.internode.internode_rows import rail_slot_bytes
    G, N = world.gpus, world.world_size // world.gpus
    T = load_extension().transport
    module = types.SimpleNamespace(
        HierLaunch=T.HierLaunch, HierDispatchLaunch=T.HierDispatchLaunch, HierCombineLaunch=T.HierCombineLaunch,
        hier_dispatch=lambda launch, keys, stream: launches.append(("dispatch", launch)),
        hier_combine=lambda launch, keys, stream: launches.append(("combine", launch)))
    tr = QueuedRail(world, rank, rail_slot_bytes(max_tokens, hidden) + 64, [m * G + rank % G for m in range(N)])
    tr.T, tr.keys, tr.round, tr.lkey, tr.err_dev, tr.timeout_s = module, None, 0, 7, 0x80, 2.0
    tr.mem, tr.offsets = types.SimpleNamespace(ptr=0x10000), {"send": 0, "recv": 0x100, "signal": 0x200, "credit": 0}
    link = RecordedArea(world, rank)
    comm = HierComm(tr, link, rank, world.world_size, G, torch.device("cpu"))
    comm.node_headers = False  # as HierKernels.__init__ sets it
    k = HierKernels.__new__(HierKernels)
    k.comm, k.tr, k.link, k.device_puts = comm, tr, link, None
    k.agreement = DeferredAgreement()
    k._make_counters(torch.device("cpu"))
    k.event, k._last_stream = None, None
    k.peer_table = torch.zeros(max(1, N - 1), 4, dtype=torch.int64)
    k.rdma_blocks, k.nvl_blocks, k.nic_blocks = 3, 5, 2
    return k
