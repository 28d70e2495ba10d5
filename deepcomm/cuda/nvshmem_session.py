"""NVSHMEM in this process: bootstrapping it by unique id (over torch.distributed or an mpi4py communicator), and
the symmetric allocations every Buffer of the process shares. The library itself: nvshmem_library.py.

NVSHMEM is initialized at most once per process, over one ordered set of ranks (PE ``i`` is rank ``i`` of that
set). The first user initializes it: ``deepcomm.launch_mpi`` under mpirun, else the first Buffer that puts its
low-latency buffer on NVSHMEM. Later Buffers must use a group with the same ranks. ``finalize()`` is collective
and final: NVSHMEM is not initialized again in the same process.

Freeing symmetric memory is collective in NVSHMEM, but a Buffer may be closed on one rank alone (``__del__``), so
``release()`` is local: a block is freed at the next collective point (the next allocation) once every rank has
released it, in the same order everywhere.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from .nvshmem_library import NvshmemUnavailableError, load_library

HEAP_MARGIN = 256 << 20   # NVSHMEM's own symmetric objects, alignment
HEAP_ROUND = 1 << 30


class Session:
    """The initialized NVSHMEM of this process."""

    def __init__(self, ranks: Tuple[int, ...], rank: int, device: int, how: str):
        self.ranks, self.rank, self.device, self.how = ranks, rank, device, how
        self.blocks: Dict[int, int] = {}   # block id -> pointer, for blocks not freed yet
        self.released: Set[int] = set()    # released here, waiting for every rank
        self.next_id = 0

    @property
    def world_size(self) -> int:
        return len(self.ranks)


_session: Optional[Session] = None
_finalized = False


def _size_heap(heap_bytes: Optional[int]) -> None:
    """Set NVSHMEM_SYMMETRIC_SIZE (bytes per GPU) for a first allocation of ``heap_bytes``, unless the user did."""
    if heap_bytes and "NVSHMEM_SYMMETRIC_SIZE" not in os.environ:
        size = max(HEAP_ROUND, (heap_bytes + HEAP_MARGIN + HEAP_ROUND - 1) // HEAP_ROUND * HEAP_ROUND)
        os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(size)


def _init(unique_id_from_root, rank: int, ranks: Tuple[int, ...], device: int, how: str,
          heap_bytes: Optional[int]) -> Session:
    global _session
    if _finalized:
        raise RuntimeError("deepcomm: NVSHMEM was finalized in this process and cannot be initialized again")
    if _session is not None:
        raise RuntimeError(f"deepcomm: NVSHMEM is already initialized in this process (through {_session.how})")
    n = load_library()
    _size_heap(heap_bytes)
    # Rank 0's failure to make the id travels instead of it, so no rank waits for an id that never comes.
    payload = None
    if rank == 0:
        try:
            payload = n.get_unique_id()
        except RuntimeError as exc:
            payload = f"rank 0 could not make the NVSHMEM unique id: {exc}"
    uid = unique_id_from_root(payload)
    if isinstance(uid, str):
        raise NvshmemUnavailableError(uid)
    try:
        n.init_with_unique_id(uid, rank, len(ranks), device)
    except RuntimeError as exc:
        raise NvshmemUnavailableError(f"NVSHMEM failed to initialize on rank {rank} (device {device}, "
                                      f"{len(ranks)} ranks, through {how}): {exc}") from None
    _session = Session(tuple(ranks), rank, device, how)
    return _session


def init_with_torch(group=None, device: Optional[int] = None, heap_bytes: Optional[int] = None) -> Session:
    """Collective over ``group``: rank 0 makes the unique id, ``broadcast_object_list`` carries it (bounded by the
    group's timeout), every rank initializes NVSHMEM as PE = its rank in ``group``."""
    group = dist.group.WORLD if group is None else group
    rank = dist.get_rank(group)
    device = torch.cuda.current_device() if device is None else device

    def exchange(uid):
        box = [uid]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return box[0]

    return _init(exchange, rank, tuple(dist.get_process_group_ranks(group)), device, "torch.distributed",
                 heap_bytes)


def init_with_mpi(comm, device: Optional[int] = None, heap_bytes: Optional[int] = None) -> Session:
    """Collective over an mpi4py communicator (no MPI linking: the unique id travels with ``comm.bcast``); PE =
    rank in ``comm``. Under deepcomm.launch_mpi the torch.distributed global rank equals the MPI rank."""
    rank = comm.Get_rank()
    device = torch.cuda.current_device() if device is None else device
    return _init(lambda uid: comm.bcast(uid, root=0), rank, tuple(range(comm.Get_size())), device, "MPI",
                 heap_bytes)


def current() -> Optional[Session]:
    return _session


def is_initialized() -> bool:
    return _session is not None


def session_for(group, heap_bytes: Optional[int] = None) -> Session:
    """The session, initialized over ``group`` if there is none yet; ``group`` must span the session's ranks."""
    ranks = tuple(dist.get_process_group_ranks(group))
    session = _session or init_with_torch(group, heap_bytes=heap_bytes)
    if session.ranks != ranks:
        raise ValueError(f"group: NVSHMEM in this process spans ranks {list(session.ranks)} (initialized through "
                         f"{session.how}); this group has ranks {list(ranks)}. NVSHMEM is initialized once per "
                         "process: use groups with the same ranks, or DEEPCOMM_LL_MEMORY=ipc")
    return session


def allocate(group, nbytes: int) -> Tuple[int, int]:
    """Collective over ``group``: ``(block id, pointer)`` of ``nbytes`` of symmetric memory (not zeroed). Blocks
    every rank has released are freed first."""
    session = session_for(group, heap_bytes=nbytes)
    n = load_library()
    released: List[List[int]] = [None] * session.world_size  # type: ignore[list-item]
    dist.all_gather_object(released, sorted(session.released), group=group)
    for block in sorted(set.intersection(*(set(r) for r in released))):
        n.symmetric_free(session.blocks.pop(block))
        session.released.discard(block)
    ptr = n.symmetric_alloc(nbytes)
    block, session.next_id = session.next_id, session.next_id + 1
    session.blocks[block] = ptr
    return block, ptr


def release(block: int) -> None:
    """Local: the block is ours no more; it is freed at the next allocation once every rank released it."""
    if _session is not None and block in _session.blocks:
        _session.released.add(block)


def peer_ptrs(ptr: int, world_size: int, allow_unreachable: bool = False) -> List[int]:
    """Every PE's copy of the symmetric block at ``ptr``, mapped here (``nvshmem_ptr``); ours at our PE. A PE with
    no load/store mapping is 0 with ``allow_unreachable`` (the caller reaches it by puts), else an error."""
    n = load_library()
    out = [n.peer_ptr(ptr, pe) for pe in range(world_size)]
    unreachable = [pe for pe, p in enumerate(out) if p == 0]
    if unreachable and not allow_unreachable:
        raise RuntimeError(f"deepcomm: NVSHMEM gives no load/store mapping of ranks {unreachable} (nvshmem_ptr "
                           "returned NULL): the low-latency kernels need every peer reachable over NVLink / P2P; "
                           "use DEEPCOMM_LL_MEMORY=ipc, or keep the group on one NVLink domain")
    return out


def barrier() -> None:
    """``nvshmem_barrier_all`` over the session's ranks."""
    if _session is None:
        raise RuntimeError("deepcomm: NVSHMEM is not initialized")
    load_library().barrier_all()


def finalize() -> None:
    """Collective over the session's ranks: end NVSHMEM in this process (frees every symmetric block). No-op when
    it was never initialized. Call it after the Buffers using NVSHMEM memory are destroyed and their streams idle."""
    global _session, _finalized
    if _session is None:
        return
    torch.cuda.synchronize(_session.device)
    _session, _finalized = None, True
    load_library().finalize()
