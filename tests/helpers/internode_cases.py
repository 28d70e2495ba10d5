"""The internode test cases both transports run (tests/internode/test_internode.py: the device emulated NIC;
test_internode_nvshmem.py: NVSHMEM puts): on 2 GPUs as 2 nodes x 1 GPU (4 GPUs: also 2 x 2), dispatch (BF16, FP8,
with weights, ugly routings), cached re-dispatch, combine and FP8 combine against the reference backend bit for bit,
and after every call what the transport carried to each rail peer against what the hierarchical route had to send
(each token once per remote node, one partial per (token, node) back), in the transport's own units. A block
that carries the call's fingerprint (deepcomm/internode/hier_agree.py) has its 64 bytes in front: every block of the
dedicated kernels, and with call agreement on (one GPU per node) every call's first exchange."""
from __future__ import annotations

import torch

from tests.helpers.same_bits import assert_same as _same

E, K, M = 16, 4, 128
HEADER = 64  # deepcomm.internode.internode_rows.RAIL_HEADER_BYTES, restated: the test computes the bytes independently


def _routing(gen, T, mode, device):
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    if mode == "one_expert":  # every token to expert E-1 only: all rows go to rank 1
        idx[:] = -1
        idx[:, 0] = E - 1
    if mode == "masked":
        idx[torch.rand(T, K, generator=gen) < 0.4] = -1
    return idx.to(device), torch.rand(T, K, generator=gen).to(device)




def _same_handle(a, b, what):
    for f in ("num_experts", "num_tokens", "hidden", "num_recv", "is_token_in_rank", "send_pos", "count_matrix",
              "recv_src_idx", "num_recv_tokens_per_expert"):
        _same(getattr(a, f), getattr(b, f), f"{what}: handle.{f}")


def _delta(after, before):
    return {k: after[k] - before[k] for k in after}


def _row(*byte_counts):
    return (sum(byte_counts) + 15) // 16 * 16


def check_cases(rank, world, gpn, buf, ref, totals, expected, label):
    """Run every case on ``buf`` (the CUDA internode backend) and ``ref`` (the reference backend). ``totals()``:
    per rail peer, the transport's cumulative counters; ``expected(round_bytes)``: the counters a list of rounds'
    block sizes to one peer adds; ``label`` names the counters in messages."""
    import torch.distributed as dist

    from deepcomm import layout
    from deepcomm.fp8 import per_token_cast_to_fp8

    dev = buf.device
    G, N = gpn, world // gpn
    # header bytes: in every kernel launch's blocks (the kernels' sections always start with one), and in the
    # first exchange of every call where the backend compares fingerprints
    agrees = buf._backend.capabilities.takes_fingerprints
    kernel_head = HEADER if buf._backend.kernels is not None else 0
    first_head = HEADER if agrees or kernel_head else 0  # the launch of a cached dispatch or a combine
    count_head = HEADER if agrees else 0
    # a combine on the kernels with several GPUs per node carries the words of every GPU of our node in its header
    # (their strip on the receiving node: hier_kernels.hpp, words_at)
    combine_head = HEADER * G if agrees and kernel_head and G > 1 else first_head
    # the kernels' count round also carries our tokens per expert (E int32: the receivers' rows per expert) and
    # our count of expert ids outside [-1, E) (int32; csrc/runtime/hier_route_layout.hpp)
    count_experts = 4 * E + 4 if buf._backend.kernels is not None else 0
    node, local = divmod(rank, G)
    peers = [m * G + local for m in range(N) if m != node]  # RDMA only to our local index on the other nodes
    mask = 4 if G > 1 else 0  # with several GPUs per node a payload row carries the node's GPU mask (int32)
    gen = torch.Generator().manual_seed(70 + rank)
    cases = [(0 if rank == 0 else 37, "random", 2880, False), (1, "random", 2880, False),
             (50, "one_expert", 2880, False), (64, "masked", 2880, False), (M, "random", 7168, False),
             (M, "masked", 7168, True), (0 if rank == 1 else 5, "random", 7168, True)]
    for T, mode, H, fp8 in cases:
        what = f"rank {rank}, T={T} {mode} H={H} {'fp8' if fp8 else 'bf16'}"
        idx, w = _routing(gen, T, mode, dev)
        x16 = (torch.randn(T, H, generator=gen) * 3).to(torch.bfloat16).to(dev)
        x = per_token_cast_to_fp8(x16) if fp8 else x16

        before = totals()
        out_r = ref.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        out_n = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        for i, name in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights", "per_expert")):
            _same(out_n[i], out_r[i], f"{what}: {name}")
        _same_handle(out_n[4], out_r[4], what)
        # Exactly the counts round (our row of R int32, with G > 1 our N node counts, on the kernels our E expert
        # counts and bad-id count, padded to 16 bytes) and
        # the payload round (one row per token that has an expert on the peer's node: x [+ scales] + int64 ids +
        # int32 source index + fp32 weights [+ node mask], padded to 16 bytes) travelled to each rail peer.
        in_rank = layout.token_in_rank(idx.cpu(), E, world)
        everyone = [None] * world  # every rank's routing: what we forward and reduce for our rail's sources
        dist.all_gather_object(everyone, in_rank)
        to_node = in_rank.view(T, N, G).any(dim=2).sum(dim=0).tolist()  # our tokens per node, once each
        x_bytes = H + H // 128 * 4 if fp8 else 2 * H
        after = totals()
        assert sorted(after) == peers, f"{what}: {label} to {sorted(after)}, expected the rail {peers}"
        for peer in peers:
            got = _delta(after[peer], before[peer])
            want = expected([count_head + _row(4 * world + (4 * N if G > 1 else 0) + count_experts),
                              kernel_head + to_node[peer // G] * _row(x_bytes, 8 * K, 4, 4 * K, mask)])
            assert got == want, f"{what}: {label} to {peer}: {got}, expected {want}"

        # cached re-dispatch (no ids: weights travel as given)
        x2 = (torch.randn(T, H, generator=gen)).to(torch.bfloat16).to(dev)
        x2 = per_token_cast_to_fp8(x2) if fp8 else x2
        w2 = torch.rand(T, K, generator=gen).to(dev)
        before = totals()
        again_r = ref.dispatch(x2, handle=out_r[4], topk_weights=w2)
        again_n = buf.dispatch(x2, handle=out_n[4], topk_weights=w2)
        for i, name in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights", "per_expert")):
            _same(again_n[i], again_r[i], f"{what}: cached {name}")
        after = totals()
        for peer in peers:
            got = _delta(after[peer], before[peer])
            want = expected([first_head + to_node[peer // G] * _row(x_bytes, 4 * K, mask)])
            assert got == want, f"{what}: cached, {label} to {peer}: {got}, expected {want}"

        # combine (expert outputs and weights), then the FP8 combine where H allows it
        n = out_n[4].num_recv
        y = torch.randn(n, H, generator=gen).to(torch.bfloat16).to(dev)
        yw = torch.rand(n, K, generator=gen).to(dev)
        def combine_bytes(peer, held_row_bytes, weight_bytes):
            """One row per token of `peer` that our node holds: as held when one GPU holds it, else fp32."""
            holders = everyone[peer][:, node * G:node * G + G].sum(dim=1)
            return (int((holders == 1).sum()) * _row(held_row_bytes, weight_bytes)
                    + int((holders > 1).sum()) * _row(4 * H, weight_bytes))

        before = totals()
        _same(buf.combine(y, out_n[4], topk_weights=yw), ref.combine(y, out_r[4], topk_weights=yw),
              f"{what}: combine")
        after = totals()
        for peer in peers:  # node partials go back to their source
            got = _delta(after[peer], before[peer])
            want = expected([combine_head + combine_bytes(peer, 2 * H, 4 * K)])
            assert got == want, f"{what}: combine, {label} to {peer}: {got}, expected {want}"
        if H % 128 == 0:  # the FP8 combine needs whole 128-value blocks
            before = totals()
            _same(buf.combine(y, out_n[4], use_fp8=True), ref.combine(y, out_r[4], use_fp8=True),
                  f"{what}: fp8 combine")
            after = totals()
            for peer in peers:
                got = _delta(after[peer], before[peer])
                want = expected([combine_head + combine_bytes(peer, H + H // 128 * 4, 0)])
                assert got == want, f"{what}: fp8 combine, {label} to {peer}: {got}, expected {want}"



def check_bad_ids(rank, world, buf, ref):
    """The last rank passes expert ids outside [-1, E) (one far past every table): on the kernels (ids checked by
    the route kernel, no host sync) every rank raises after the count round, that rank naming how many, the others
    naming it; then an agreeing dispatch and combine on the same Buffer are bit-exact against the reference."""
    dev = buf.device
    gen = torch.Generator().manual_seed(90 + rank)
    T, H = 33, 2880
    idx, w = _routing(gen, T, "random", dev)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
    bad = world - 1
    if rank == bad:
        idx = idx.clone()
        idx[3, 1], idx[7, 0] = E, 1 << 40
    try:
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    except ValueError as e:
        got = str(e)
    else:
        raise AssertionError(f"rank {rank}: a dispatch with bad expert ids on rank {bad} returned")
    want = f"topk_idx: 2 expert ids outside [-1, {E})" if rank == bad else f"topk_idx: rank {bad} passed expert ids"
    assert got.startswith(want), f"rank {rank}: {got}"
    idx, w = _routing(gen, T, "masked", dev)
    out_r = ref.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    out_n = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    for i, name in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights", "per_expert")):
        _same(out_n[i], out_r[i], f"rank {rank}, after bad ids: {name}")
    y = torch.randn(out_n[4].num_recv, H, generator=gen).to(torch.bfloat16).to(dev)
    _same(buf.combine(y, out_n[4]), ref.combine(y, out_r[4]), f"rank {rank}, after bad ids: combine")
