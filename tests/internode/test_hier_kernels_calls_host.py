"""Host-side pieces of the internode kernels' calls (deepcomm/internode/hier_kernels.py) that need no GPU, with the
ranks as threads (tests/helpers/threaded_world.py): a fresh dispatch's count round queued over both hops without a
host wait (one put per node GPU for the rail's rows), whose counts (count matrix, node counts, rows per local
expert) equal the reference backend's; the rows packed in one pass equal a zero fill plus a copy per part (the
kernels' own row building and splitting: test_hier_rows_host.py); the call words of launches the host does not
wait for, compared later (deepcomm/internode/deferred_agree.py), with the reference's text."""
from __future__ import annotations

import types

import pytest
import torch

from deepcomm import agreement
from deepcomm.dispatch_rows import as_byte_rows, part_row_bytes
from deepcomm.internode.deferred_agree import DeferredAgreement
from deepcomm.internode.hier_comm import HierComm
from deepcomm.internode.hier_kernels import fresh_counts
from deepcomm.internode.hier_normal import pack_rows
from deepcomm.internode.internode_rows import max_node_row_bytes, rail_slot_bytes
from deepcomm.reference import normal
from tests.helpers.hier_stand_ins import QueuedRail, recording_kernels, recording_world
from tests.helpers.threaded_world import NodeArea, ThreadComm, World, run

E, K, H, M = 24, 3, 64, 40


class CountedArea(NodeArea):
    def __init__(self, *args):
        super().__init__(*args)
        self.syncs = self.puts = 0

    def put(self, *args):
        self.puts += 1
        super().put(*args)

    def synchronize(self):
        self.syncs += 1

    def check_error(self):
        pass


def _ids(rank, seed):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    T = 3 + 7 * rank % 11
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    idx[torch.rand(T, K, generator=gen) < 0.25] = -1
    idx[0, 1] = idx[0, 0]  # the same expert twice in one token: it still counts once
    return idx.contiguous()


@pytest.mark.parametrize("nodes,gpn,align", [(3, 1, 1), (2, 2, 4), (2, 3, 1), (3, 2, 1)])
def test_fresh_counts_are_queued_once_and_equal_the_reference(nodes, gpn, align):
    R = nodes * gpn
    world = World(R, gpn, area_bytes=R * M * max_node_row_bytes(H), timeout_s=120.0)

    def fn(rank):
        tr = QueuedRail(world, rank, rail_slot_bytes(M, H), [m * gpn + rank % gpn for m in range(nodes)])
        link = CountedArea(world, rank)
        comm = HierComm(tr, link, rank, R, gpn, torch.device("cpu"))
        k = types.SimpleNamespace(comm=comm, tr=tr, link=link, agreement=DeferredAgreement())
        ref = ThreadComm(world, rank)
        for seed in range(3):
            idx = _ids(rank, seed)
            T = idx.shape[0]
            x = torch.randn(T, H).to(torch.bfloat16)
            words = agreement.dispatch(seed + 1, 1, x, idx, None, E, None) if gpn == 1 else None
            route, cm, ncm, counts, ncounts, per_expert = fresh_counts(k, idx, E, T, align, words)
            in_rank, send_pos = route.in_rank, route.send_pos
            want = normal.dispatch(ref, x, idx, None, E, None, align)
            h = want[4]
            assert per_expert == list(want[3]), f"rank {rank}: rows per expert {per_expert} != {want[3]}"
            assert torch.equal(cm, h.count_matrix) and counts == h.count_matrix.tolist()
            assert torch.equal(in_rank, h.is_token_in_rank) and torch.equal(send_pos, h.send_pos)
            node_of = h.is_token_in_rank.view(T, nodes, gpn).any(dim=2).sum(dim=0).tolist()
            assert ncounts[rank] == (node_of if gpn > 1 else counts[rank])
            assert ncm.tolist() == ncounts
        assert tr.waits and not any(tr.waits), f"rank {rank}: a count round waited: {tr.waits}"
        assert link.syncs == 0, f"rank {rank}: the NVLink hop synchronized {link.syncs} times"
        # the rail's rows go to each node GPU as one block, however many nodes (each put is a copy call on a GPU)
        want_puts = 3 * (gpn if gpn > 1 else 0)
        assert link.puts == want_puts, f"rank {rank}: {link.puts} puts into the node GPUs, want {want_puts}"
        return True

    assert all(run(world, fn))


def _old_pack(parts, rows, stride, at):
    out = torch.zeros(rows, stride, dtype=torch.uint8)
    for p, o in zip(parts, at):
        n = part_row_bytes(p)
        out[:, o:o + n] = as_byte_rows(p, rows, n)
    return out


@pytest.mark.parametrize("rows", [0, 1, 9])
def test_pack_rows_in_one_pass_equals_fill_and_copies(rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 10, generator=gen).to(torch.bfloat16)
    ids = torch.randint(-1, 50, (rows, 3), generator=gen)
    src = torch.arange(rows, dtype=torch.int32)
    w = torch.rand(rows, 3, generator=gen)
    parts = [x, ids, src, w]
    side = [0, 20, 44, 48]
    assert torch.equal(pack_rows(parts, rows, 64), _old_pack(parts, rows, 64, side))
    gaps = [0, 24, 52, 60]  # gaps between parts are zeros
    assert torch.equal(pack_rows(parts, rows, 80, at=gaps), _old_pack(parts, rows, 80, gaps))
    with pytest.raises(ValueError, match="at"):
        pack_rows(parts, rows, 80, at=[0, 16, 52, 60])
    with pytest.raises(ValueError, match="stride"):
        pack_rows(parts, rows, 48)


def test_deferred_agreement_compares_later_with_the_reference_text():
    from deepcomm.internode.deferred_agree import _headers
    R, slot = 3, 256

    class Slots:  # a transport's memory: receive slot s at recv + s * slot
        world_size, slot_bytes, device = R, slot, torch.device("cpu")
        offsets = {"send": 0, "recv": R * slot}
        region = torch.zeros(2 * R * slot, dtype=torch.uint8)

    x = torch.zeros(4, H, dtype=torch.bfloat16)
    handle = types.SimpleNamespace(call=3)
    good = list(agreement.combine(4, 1, x, handle, None, False))
    bad = list(agreement.combine(4, 1, x, handle, None, True))
    tr = Slots()

    def land(words_of):  # what each rank sent us lands in its slot
        for s, words in words_of.items():
            o = tr.offsets["recv"] + s * slot
            tr.region[o:o + 4 * agreement.WORDS] = torch.tensor(words, dtype=torch.int32).view(torch.uint8)

    class Done:  # the event of the copy after the launch (CPU: the copy is made at once)
        def __init__(self):
            self.ran = False

        def query(self):
            return self.ran

        def synchronize(self):
            self.ran = True

    def queue():  # what DeferredAgreement.add does after a launch, the copy made now
        done = Done()
        d._pending.append((done, _headers(tr, "recv").contiguous().clone(), {0: 0, 1: 1, 2: 2}, good, 0))
        return done

    d = DeferredAgreement()
    land({1: good, 2: good})
    queue()
    d.collect()  # the copy has not run: nothing compared, nothing raised
    assert len(d) == 1
    d.collect(wait=True)
    assert len(d) == 0
    d.raise_pending()  # every rank agreed
    land({1: good, 2: bad})
    done = queue()
    land({1: good, 2: good})  # the next round's words: the copy made after the launch is what counts
    done.ran = True
    d.collect()
    with pytest.raises(ValueError) as got:
        d.raise_pending()
    with pytest.raises(ValueError) as want:
        agreement.check([good, good, bad])
    assert str(got.value) == str(want.value)
    d.raise_pending()  # raised once


def _local_fits(comm, counts, ncounts, stride, slot_bytes, area_bytes):
    """What one rank alone could check of a dispatch: its own rail blocks and its node's areas."""
    N = comm.num_nodes
    rail = [ncounts[comm.rank][m] for m in range(N)] + [ncounts[comm.rank_of(m, comm.local)][comm.node]
                                                         for m in range(N)]
    area = [sum(counts[s][d] for s in range(comm.world_size)) for d in comm.node_ranks()]
    return max(rail) * stride + 64 <= slot_bytes and max(area) * stride <= area_bytes


@pytest.mark.parametrize("what", ["slot", "area", "combine area"])
def test_a_launch_too_large_for_one_rank_is_refused_on_every_rank_alike(what):
    """Rank 0 sends many rows to node 1: only some ranks' own blocks and areas are too small, yet every rank (2
    nodes x 2 GPUs) refuses with the same message, from the counts every rank has after the count round."""
    from deepcomm.internode.hier_kernels import HierKernels
    R, G, stride = 4, 2, 16
    counts = [[1] * R for _ in range(R)]
    counts[0][2] = counts[0][3] = 50  # rank 0's tokens for node 1's GPUs
    ncounts = [[max(counts[s][0], counts[s][1]), max(counts[s][2], counts[s][3])] for s in range(R)]
    slot = 64 + stride * (50 if what != "slot" else 10)
    area = stride * (1000 if what == "slot" else 20)
    texts, alone = set(), []
    for rank in range(R):
        comm = HierComm(None, None, rank, R, G, torch.device("cpu"))
        k = types.SimpleNamespace(comm=comm, tr=types.SimpleNamespace(slot_bytes=slot),
                                  link=types.SimpleNamespace(area_bytes=area))
        alone.append(_local_fits(comm, counts, ncounts, stride, slot, area))
        with pytest.raises(ValueError, match="^x: ") as got:
            HierKernels.check_fits(k, counts, ncounts, stride, stride, combine=what == "combine area")
        texts.add(str(got.value))
    assert len(texts) == 1, texts
    if what != "combine area":
        assert any(alone), "some rank's own blocks fit: a per-rank check would have let it launch"


@pytest.mark.parametrize("nodes,gpn", [(2, 1), (2, 2), (2, 3), (3, 2), (4, 8), (12, 1)])
def test_route_extents_are_every_ranks_largest_block_and_area(nodes, gpn):
    """route_extents against the definitions rank by rank: the widest rail block is the largest node count; a
    dispatch fills rank d's area with every source's rows for d; a combine fills the area of the forwarder (local
    l, node n) with the rows of every rank of rail l for every GPU of node n."""
    from deepcomm.internode.hier_kernels import route_extents
    gen = torch.Generator().manual_seed(nodes * 10 + gpn)
    R = nodes * gpn
    counts = torch.randint(0, 50, (R, R), generator=gen).tolist()
    ncounts = torch.randint(0, 50, (R, nodes), generator=gen).tolist()
    comm = HierComm(None, None, 0, R, gpn, torch.device("cpu"))
    widest = max(n for row in ncounts for n in row)
    area = max(sum(counts[s][d] for s in range(R)) for d in range(R))
    forwarders = [sum(counts[comm.rank_of(m, r % gpn)][e] for m in range(nodes) for e in comm.node_ranks(r // gpn))
                  for r in range(R)]
    assert route_extents(comm, counts, ncounts, False) == (widest, area)
    assert route_extents(comm, counts, ncounts, True) == (widest, max(forwarders))


def test_a_launch_that_fits_everywhere_passes():
    from deepcomm.internode.hier_kernels import HierKernels
    counts = [[3, 1, 2, 0], [0, 4, 1, 1], [2, 2, 2, 2], [1, 0, 0, 5]]
    ncounts = [[max(r[0], r[1]), max(r[2], r[3])] for r in counts]
    for rank in range(4):
        comm = HierComm(None, None, rank, 4, 2, torch.device("cpu"))
        k = types.SimpleNamespace(comm=comm, tr=types.SimpleNamespace(slot_bytes=64 + 5 * 32),
                                  link=types.SimpleNamespace(area_bytes=16 * 32))
        HierKernels.check_fits(k, counts, ncounts, 32, 32)
        HierKernels.check_fits(k, counts, ncounts, 32, 32, combine=True)


def _int64s(ptr, n):
    import ctypes
    return list((ctypes.c_int64 * n).from_address(ptr)) if n else []


@pytest.mark.parametrize("nodes,gpn", [(2, 1), (2, 2)])
def test_calls_hand_their_kernels_the_plans_tables(monkeypatch, nodes, gpn):
    """The host path of a fresh dispatch, a cached one and combines with the launches recorded instead of run
    (tests/helpers/hier_stand_ins.py): the fresh dispatch asks for local ids from this rank's first expert (a
    cached one for none) and a cached dispatch takes the fresh one's slot and first-row tables; the combine's
    gather and area tables, read at the pointers it passes (one copy to the device holds both), are the combine
    plan's, where the tokens' partials land comes from the fresh dispatch's route tables (rdma slots, held slots,
    single-held counts), and a second combine of the route gets the first one's tables."""
    from deepcomm.internode import hier_kernels as hk
    recording_world(monkeypatch.setattr)
    R = nodes * gpn
    E = 4 * R
    world = World(R, gpn, area_bytes=R * M * max_node_row_bytes(H), timeout_s=120.0)

    def fn(rank):
        launches = []
        k = recording_kernels(world, rank, launches, M, H)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(M, H, generator=gen).to(torch.bfloat16)
        idx = torch.rand(M, E, generator=gen).topk(K, dim=1).indices
        w = torch.rand(M, K, generator=gen)
        h = hk.dispatch(k, x, idx, w, E, None, 1, None)[4]
        fresh = launches[-1][1]
        assert (fresh.first_expert, fresh.local_experts) == (rank * (E // R), E // R)
        hk.dispatch(k, x, None, w, E, h, 1, None)
        cached, tables = launches[-1][1], h.node_route.tables
        assert cached.local_experts == 0  # a cached dispatch has no ids to make local
        assert cached.rdma_slot == tables["rdma_slot"].data_ptr() == fresh.rdma_slot
        assert cached.first_row == tables["first_row"].data_ptr() == fresh.first_row
        y = torch.randn(h.num_recv, H, generator=gen).to(torch.bfloat16)
        held = hk.held_row(H, K, False)["stride"]
        plan = hk.combine_plan(k.comm, h.node_route.counts, held)
        first = None
        for _ in range(2):
            hk.combine(k, y, h, torch.rand(h.num_recv, K, generator=gen), False, None)
            launch = launches[-1][1]  # its tables live on in the route: read them after the call
            assert _int64s(launch.gather, 3 * R) == [v for row in plan["gather"] for v in row]
            assert _int64s(launch.area_off, nodes * gpn) == [v for row in plan["area_off"] for v in row]
            # where each token's partials land: the fresh dispatch's route tables, as they are
            assert (launch.rdma_slot, (launch.held_slot, launch.one_held)) == (fresh.rdma_slot, tables["held"])
            assert (launch.one_held != 0) == (gpn > 1)
            assert gpn > 1 or launch.held_slot == launch.rdma_slot  # one GPU per node: the send positions
            assert first is None or launch.gather == first
            first = launch.gather
        assert tables["combine"][held][1].data_ptr() == first
        return True

    assert all(run(world, fn))
