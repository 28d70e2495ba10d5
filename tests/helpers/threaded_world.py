"""Every rank of a large job in one process, one thread per rank, for CPU checks of routing code at sizes no
process-per-rank test can afford (16 x 8 = 128 ranks and more on 2 cores).

``World(R, G)`` holds what the ranks share: a board for all-gathers and the node areas of the NVLink hop.
Per rank it hands out stand-ins with the interfaces the routing code calls:

- ``ThreadComm``: the reference backend's ``Comm`` (deepcomm/reference/collectives.py) with its all_gather and
  all_to_all done between the threads, so the reference backend's own dispatch / combine code runs unchanged;
- ``RailTransport``: the RDMA hop of ``HierComm`` (NicTransport's interface): a round delivers each rank's block
  for each rail peer, and refuses bytes for any other rank; a round waits for the rail's ranks only;
- ``NodeArea``: the NVLink hop of ``HierComm`` (NodeLink's interface): every rank's area is a tensor the node's
  threads write; a fence is a barrier of the node's ranks only, and an area is poisoned before every stage, so
  stale rows are never read as fresh ones.

As on GPUs, a rail round pairs with the rail's next round and a fence with the node's next fence, whatever stage
each rank is in: ranks whose calls take the two hops in different orders can wait for each other in a circle,
which the barriers' timeout breaks (``threading.BrokenBarrierError`` on every waiting rank).

``run(world, fn)`` calls ``fn(rank)`` on every thread and returns the results by rank; the first exception is
raised in the caller, and a failing rank breaks the barrier so no thread waits forever.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, List

import torch

from deepcomm.dispatch_rows import as_byte_rows, part_row_bytes, unpack_rows
from deepcomm.reference.collectives import Comm, PendingRows

POISON = 0xEE


class Group:
    """A barrier and a board among some ranks (all of them, a node's or a rail's)."""

    def __init__(self, ranks: List[int], timeout_s: float):
        self.ranks = ranks
        self.barrier = threading.Barrier(len(ranks), timeout=timeout_s)
        self.board: Dict[int, object] = {}

    def wait(self) -> None:
        self.barrier.wait()

    def all_gather(self, rank: int, obj) -> Dict[int, object]:
        """Every member's ``obj``, by rank (a collective of the group's threads)."""
        self.board[rank] = obj
        self.wait()
        out = dict(self.board)
        self.wait()  # nobody overwrites the board before everyone has read it
        return out


class World:
    def __init__(self, world_size: int, gpus_per_node: int, area_bytes: int = 0, timeout_s: float = 300.0):
        self.world_size, self.gpus = world_size, gpus_per_node
        G = gpus_per_node
        self.everyone = Group(list(range(world_size)), timeout_s)
        self.barrier = self.everyone.barrier
        self.nodes = [Group(list(range(n, n + G)), timeout_s) for n in range(0, world_size, G)]
        self.rails = [Group(list(range(l, world_size, G)), timeout_s) for l in range(G)]
        self.areas = [torch.full((area_bytes,), POISON, dtype=torch.uint8) for _ in range(world_size)]

    def groups(self) -> List[Group]:
        return [self.everyone] + self.nodes + self.rails

    def wait(self) -> None:
        self.everyone.wait()

    def all_gather(self, rank: int, obj) -> list:
        """Every rank's ``obj``, by rank (a collective of all threads)."""
        got = self.everyone.all_gather(rank, obj)
        return [got[r] for r in range(self.world_size)]


def run(world: World, fn: Callable[[int], object]) -> list:
    results: Dict[int, object] = {}
    errors: List[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors.append(exc)
            for group in world.groups():
                group.barrier.abort()

    torch.set_num_threads(1)
    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return [results[r] for r in range(world.world_size)]


class ThreadComm(Comm):
    """The reference backend's communicator over the threads of ``world``."""

    def __init__(self, world: World, rank: int):
        super().__init__(None, rank, world.world_size, torch.device("cpu"), 300.0)
        self.world = world

    def all_gather(self, t: torch.Tensor, stage: str) -> torch.Tensor:
        return torch.stack(self.world.all_gather(self.rank, t.contiguous().clone()))

    def exchange_rows(self, parts, send_counts, recv_counts, stage: str) -> PendingRows:
        row_bytes = [part_row_bytes(p) for p in parts]
        packed = torch.cat([as_byte_rows(p, sum(send_counts), b) for p, b in zip(parts, row_bytes)], dim=1)
        begins = [sum(send_counts[:d]) for d in range(self.world_size)]
        mine = [packed[begins[d]:begins[d] + send_counts[d]] for d in range(self.world_size)]
        every = self.world.all_gather(self.rank, mine)
        got = [every[s][self.rank] for s in range(self.world_size)]
        assert [g.shape[0] for g in got] == list(recv_counts), stage
        out = torch.cat(got) if got else packed[:0]
        return PendingRows(lambda: unpack_rows(out, parts, row_bytes))


class RailTransport:
    """The RDMA hop between the threads: one receive slot per peer, ``peers`` only (the rail). Reading past what a
    peer sent fails, unless ``whole_slots``: then a slot holds the block followed by poison up to ``slot_bytes``,
    as a GPU slot holds stale bytes (for ranks whose calls disagree, which read the words first)."""

    def __init__(self, world: World, rank: int, slot_bytes: int, peers, whole_slots: bool = False):
        self.world, self.rank, self.slot_bytes, self.peers = world, rank, slot_bytes, set(peers) - {rank}
        self.whole_slots = whole_slots
        self.send = torch.zeros(slot_bytes * max(1, len(self.peers)), dtype=torch.uint8)
        self.recv: Dict[int, torch.Tensor] = {}
        self.rounds = 0
        self.sent: Dict[int, int] = {}  # bytes handed to each peer, over all rounds

    def send_view(self, rows: int, stride: int) -> torch.Tensor:
        return self.send[:rows * stride].view(rows, stride)

    def recv_view(self, src: int, rows: int, stride: int) -> torch.Tensor:
        assert src in self.peers, f"rank {self.rank} reads a block from {src}, not a rail peer"
        block = self.recv[src]
        assert rows * stride <= block.numel(), f"rank {self.rank} reads past what {src} sent"
        return block[:rows * stride].view(rows, stride)

    def recv_rows(self, first: int, step: int, count: int, nbytes: int) -> torch.Tensor:
        """The slots of sources first, first + step, ... as rows (a source that is not a peer: poison, as a slot
        nobody wrote holds stale bytes)."""
        srcs = [first + i * step for i in range(count)]
        return torch.stack([self.recv_view(s, 1, nbytes)[0] if s in self.peers
                            else torch.full((nbytes,), POISON, dtype=torch.uint8) for s in srcs])

    def exchange(self, send_bytes, send_begin) -> None:
        self.rounds += 1
        blocks = {}
        for d in range(self.world.world_size):
            assert d in self.peers or send_bytes[d] == 0, f"bytes for rank {d}, not a rail peer of {self.rank}"
            if d in self.peers:
                assert send_bytes[d] <= self.slot_bytes
                blocks[d] = self.send[send_begin[d]:send_begin[d] + send_bytes[d]].clone()
                self.sent[d] = self.sent.get(d, 0) + send_bytes[d]
        every = self.world.rails[self.rank % self.world.gpus].all_gather(self.rank, blocks)
        self.recv = {s: every[s][self.rank] for s in self.peers}
        if self.whole_slots:
            pad = lambda b: torch.cat([b, torch.full((self.slot_bytes - b.numel(),), POISON, dtype=torch.uint8)])  # noqa: E731
            self.recv = {s: pad(b) for s, b in self.recv.items()}


class NodeArea:
    """The NVLink hop between the threads of one node."""

    def __init__(self, world: World, rank: int):
        self.world, self.gpus = world, world.gpus
        self.local, self.first = rank % world.gpus, rank - rank % world.gpus
        self.area_bytes = world.areas[rank].numel()

    def area(self) -> torch.Tensor:
        return self.world.areas[self.first + self.local]

    def put(self, local: int, byte_offset: int, rows: torch.Tensor) -> None:
        assert rows.dtype == torch.uint8 and rows.is_contiguous()
        area = self.world.areas[self.first + local]
        assert 0 <= byte_offset and byte_offset + rows.numel() <= area.numel()
        area[byte_offset:byte_offset + rows.numel()] = rows.reshape(-1)

    def fence(self, stage: str) -> None:
        if self.gpus == 1:
            return
        if stage.endswith(":free"):
            self.area().fill_(POISON)  # only we read our area, and we are done with it
        self.world.nodes[self.first // self.gpus].wait()

    def synchronize(self) -> None:
        pass
