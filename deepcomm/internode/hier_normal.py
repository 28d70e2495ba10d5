"""Normal dispatch and combine routed hierarchically over a HierComm (hier_comm.py): one RDMA copy per
(token, remote node), to the GPU with our local index there, forwarded over NVLink inside the node; combine
reduces inside the node first and sends one partial per (token, node) back. Results, Handle included, equal
the reference backend's (deepcomm/reference/normal.py) bit for bit; the fields are described in docs/api.md.

Rows travel as uint8 rows with 16-byte strides, the parts side by side (``pack_rows``; ``unpack_rows`` of the
reference collectives reads them back).

Dispatch, at source ``s`` (node ``n``, local index ``l``), for each token:
  1. RDMA: one row per *other node* ``m`` holding any of its experts, to rank ``(m, l)``: x (or FP8 values and
     scales), [global top-k ids, source token index] (not on a cached dispatch), [weights], and, when G > 1,
     an int32 bit mask of the GPUs of ``m`` that hold its experts.
  2. NVLink: every rank forwards, for each source of its rail (ranks ``(m, l)`` of every node, itself
     included), each row to each GPU of its node named by the row's mask, at most once per GPU, into that
     GPU's area at the row the reference order gives it (``sum(count_matrix[:s, d])`` + rank among s's rows).
  3. The receiver's area then holds its rows in the reference order: it unpacks them as the reference does.
Combine, the reverse:
  1. NVLink: each rank puts the rows it holds for source ``s`` into the area of ``s``'s forwarder on its node
     (the GPU with ``s``'s local index), with their source token index; a rank's own rows for its own tokens
     stay where they are.
  2. The forwarder sums, per token of each source of its rail, the node's rows in fp32, node ranks ascending.
  3. RDMA: one partial per (token, node) to the source. A partial of one row is that row, sent as it was held
     (bf16, or e4m3 + scales with ``use_fp8``: exact, and as small as a row); a partial of several rows is fp32.
  4. The source adds the node partials in fp32, nodes ascending, and rounds once: the reference's order.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import agreement, layout
from ..fp8 import per_token_cast_back, per_token_cast_to_fp8
from ..handle import Handle
from ..dispatch_rows import as_byte_rows, dispatch_outputs, part_row_bytes, unpack_rows
from ..cuda.align import round_up
from . import hier_agree
from .hier_comm import HierComm
from .host_tables import device_table


def pack_rows(parts: Sequence[torch.Tensor], rows: int, stride: int,
              at: Optional[Sequence[int]] = None) -> torch.Tensor:
    """uint8 ``[rows, stride]``: each part's row bytes at its byte offset ``at`` (default: side by side from byte
    0), zeros in the gaps and after. One pass (a single concatenation), not a zero fill and a copy per part."""
    device = parts[0].device
    cols, col = [], 0
    for i, p in enumerate(parts):
        nbytes = part_row_bytes(p)
        start = col if at is None else at[i]
        if start < col:
            raise ValueError(f"at: part {i} at byte {start} overlaps the previous part (ending at {col})")
        if start > col:
            cols.append(torch.zeros(rows, start - col, dtype=torch.uint8, device=device))
        cols.append(as_byte_rows(p, rows, nbytes))
        col = start + nbytes
    if col > stride:
        raise ValueError(f"stride: {stride} bytes cannot hold the parts' {col}")
    if col < stride:
        cols.append(torch.zeros(rows, stride - col, dtype=torch.uint8, device=device))
    return torch.cat(cols, dim=1) if len(cols) > 1 else cols[0].clone()


def _template(cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty part with the given row shape, for ``unpack_rows``."""
    return torch.empty(0, cols, dtype=dtype, device=device)


def node_masks(is_token_in_rank: torch.Tensor, nodes: int, gpus: int) -> torch.Tensor:
    """int32 ``[T, nodes]``: bit ``g`` of ``[t, m]`` set when GPU ``g`` of node ``m`` holds an expert of ``t``."""
    T = is_token_in_rank.shape[0]
    bits = torch.arange(gpus, device=is_token_in_rank.device)
    return (is_token_in_rank.view(T, nodes, gpus).to(torch.int64) << bits).sum(dim=2).to(torch.int32)


def _mask_bits(mask_bytes: torch.Tensor, gpus: int) -> torch.Tensor:
    """bool ``[n, gpus]`` from the int32 masks stored as uint8 ``[n, 4]``."""
    masks = mask_bytes.contiguous().view(torch.int32)  # [n, 1]
    return ((masks >> torch.arange(gpus, device=masks.device)) & 1).bool()


# ---------------------------------------------------------------------------------------------------------- dispatch
def fresh_route(comm: HierComm, topk_idx: torch.Tensor, num_experts: int, T: int, fingerprint=None):
    """``(is_token_in_rank, send_pos, in_node, count_matrix, node_counts)`` of a fresh dispatch: the route from the
    ids, then the count round over both hops. ``count_matrix`` ``[R, R]``: tokens s sends to rank d;
    ``node_counts`` ``[R, N]``: to node m (the count matrix itself with one GPU per node). ``fingerprint``: the
    call's words (deepcomm/agreement.py), in front of the counts; every rank's are compared after the round
    (ValueError on every rank, hier_agree.check)."""
    R, G = comm.world_size, comm.gpus
    in_rank, send_pos, in_node, row = count_row(comm, topk_idx, num_experts, T, fingerprint)
    gathered = comm.all_gather(row, "dispatch:counts", words=fingerprint)
    if fingerprint is not None:
        hier_agree.fresh_check(comm, gathered[:, :agreement.WORDS].tolist(), fingerprint)
        gathered = gathered[:, agreement.WORDS:]
    count_matrix = gathered[:, :R].contiguous()
    node_counts = gathered[:, R:R + comm.num_nodes].contiguous() if G > 1 else count_matrix
    return in_rank, send_pos, in_node, count_matrix, node_counts


def count_row(comm: HierComm, topk_idx: torch.Tensor, num_experts: int, T: int, fingerprint=None,
              expert_counts: bool = False):
    """``(is_token_in_rank, send_pos, in_node, row)``: the route from the ids, and our int32 row of the count
    round, on the ids' device, no host sync: [the call's words], tokens per rank ``[R]``, with G > 1 tokens per
    node ``[N]``, with ``expert_counts`` tokens per expert ``[E]`` (each token once per expert it names: summed
    over the sources, a receiver's slice is its rows per local expert, so it needs no look at the rows), then
    zeros to a multiple of 4 values."""
    R, N, G = comm.world_size, comm.num_nodes, comm.gpus
    in_rank, per_expert = layout.route_and_expert_counts(topk_idx, num_experts, R)
    send_pos = layout.send_positions(in_rank)
    in_node = in_rank if G == 1 else in_rank.view(T, N, G).any(dim=2)
    pieces = [in_rank.sum(dim=0, dtype=torch.int32)]
    if G > 1:
        pieces.append(in_node.sum(dim=0, dtype=torch.int32))
    if expert_counts:
        pieces.append(per_expert)
    if fingerprint is not None:
        pieces.insert(0, device_table(list(fingerprint), torch.int32, in_rank.device))
    pad = -sum(p.numel() for p in pieces) % 4  # whole 16-byte rows: the count round sends the row as it is
    if pad:
        pieces.append(torch.zeros(pad, dtype=torch.int32, device=in_rank.device))
    return in_rank, send_pos, in_node, torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def payload_parts(rows: List[torch.Tensor], topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
                  fresh: bool) -> List[torch.Tensor]:
    """A dispatch row's parts, as the reference sends them: x (or its FP8 values and scales), then on a fresh
    dispatch the global top-k ids and the source token index, then the weights if any."""
    parts = list(rows)
    if fresh:
        parts += [topk_idx, torch.arange(rows[0].shape[0], dtype=torch.int32, device=rows[0].device)]
    if topk_weights is not None:
        parts.append(topk_weights)
    return parts


def dispatch(comm: HierComm, x, topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
             num_experts: int, handle: Optional[Handle], expert_alignment: int, fingerprint=None):
    """Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert, handle)``.
    ``fingerprint``: the call's words, compared in its first exchange (hier_agree.py)."""
    rank, R, N, G = comm.rank, comm.world_size, comm.num_nodes, comm.gpus
    is_pair = isinstance(x, (tuple, list))
    rows = list(x) if is_pair else [x]
    T, H = rows[0].shape
    dev = rows[0].device

    if handle is None:
        in_rank, send_pos, in_node, count_matrix, node_counts = fresh_route(comm, topk_idx, num_experts, T,
                                                                            fingerprint)
    else:
        in_rank, send_pos, count_matrix = handle.is_token_in_rank, handle.send_pos, handle.count_matrix
        node_counts = handle.node_count_matrix
        if node_counts is None:
            raise ValueError("handle: it has no node_count_matrix; pass a handle from this Buffer's dispatch")
        in_node = in_rank.view(T, N, G).any(dim=2)
    counts, ncounts = count_matrix.tolist(), node_counts.tolist()

    # Our rows, token order: the reference's parts, then (G > 1) room for the node mask.
    parts = payload_parts(rows, topk_idx, topk_weights, handle is None)
    row_bytes = [part_row_bytes(p) for p in parts]
    mask_at = sum(row_bytes)
    stride = round_up(mask_at + (4 if G > 1 else 0), 16)
    packed = pack_rows(parts, T, stride)

    # RDMA hop: each token once to every other node that holds any of its experts.
    masks = node_masks(in_rank, N, G) if G > 1 else None
    blocks = {}
    for m in comm.other_nodes:
        sel = in_node[:, m].nonzero()[:, 0]
        block = packed.index_select(0, sel)
        if G > 1:
            block[:, mask_at:mask_at + 4] = masks.index_select(0, sel)[:, m:m + 1].contiguous().view(torch.uint8)
        blocks[m] = [block]
    from_node = {m: ncounts[comm.rank_of(m, comm.local)][comm.node] for m in comm.other_nodes}
    first = handle is not None and fingerprint is not None  # a cached dispatch's first exchange: the words too
    got = comm.rail_exchange(blocks, {m: n * stride for m, n in from_node.items()}, "dispatch:rdma",
                             header=hier_agree.first_header(comm, fingerprint) if first else None)
    # the words heard: compared here with one GPU per node; else the rail's forwarded with the rows, compared after
    known = hier_agree.dispatch_rail(comm, fingerprint) if first else None

    # NVLink hop: forward the rows of every source of our rail to the GPUs of our node that hold them.
    with comm.node_hop("dispatch:forward") as hop:
        if known is not None:
            hier_agree.put_words(comm, hier_agree.rail_words(comm, known))
        forward = known is None or hier_agree.rail_agrees(comm, known, fingerprint)
        for m, s in enumerate(comm.rail() if forward else []):
            if s == rank:
                src, dest = packed, in_rank[:, comm.node_ranks()]
            else:
                src = got[m].view(from_node[m], stride)
                dest = (_mask_bits(src[:, mask_at:mask_at + 4], G) if G > 1
                        else torch.ones(from_node[m], 1, dtype=torch.bool, device=dev))
            for g, d in enumerate(comm.node_ranks()):
                index = dest[:, g].nonzero()[:, 0]
                if index.numel() != counts[s][d]:
                    raise RuntimeError(f"internode dispatch: rank {s} sends {counts[s][d]} rows to rank {d}, but "
                                       f"{index.numel()} rows name it (count exchange and rows disagree)")
                first_row = sum(counts[q][d] for q in range(s))
                hop.put(g, first_row * stride, src, index)
    if known is not None:
        hier_agree.check_strip(comm, known, fingerprint)

    # Our area now holds our rows in the reference order (source rank, then token).
    n_recv = sum(counts[s][rank] for s in range(R))
    area = comm.node_area()[:n_recv * stride].view(n_recv, stride).clone()
    received = unpack_rows(area, parts, row_bytes)
    out = dispatch_outputs(received, len(rows), is_pair, topk_weights is not None, handle, rank, R,
                                  num_experts, T, H, in_rank, send_pos, count_matrix, expert_alignment)
    if handle is None:
        out = out[:4] + (dataclasses.replace(out[4], node_count_matrix=node_counts),)
    return out


# ----------------------------------------------------------------------------------------------------------- combine
def combine_area_rows(comm: HierComm, counts: List[List[int]], local: int, node: int) -> Dict[Tuple[int, int], int]:
    """First row of every block (source q, holder e) in the area of the forwarder with local index ``local`` on
    node ``node``: the forwarder's rail sources ascending (the ranks with that local index), then the node's ranks
    ascending."""
    rows, row = {}, 0
    holders = comm.node_ranks(node)
    for m in range(comm.num_nodes):
        q = comm.rank_of(m, local)
        for e in holders:
            rows[(q, e)] = row
            row += counts[q][e]
    return rows


def combine_area_row(comm: HierComm, counts: List[List[int]], s: int, d: int) -> int:
    """First row of block (source s, holder d) in the area of s's forwarder on d's node (combine_area_rows)."""
    return combine_area_rows(comm, counts, s % comm.gpus, d // comm.gpus)[(s, d)]


def combine(comm: HierComm, x: torch.Tensor, handle: Handle, topk_weights: Optional[torch.Tensor],
            use_fp8: bool = False, fingerprint=None):
    """Returns ``(combined_x, combined_topk_weights)`` (see the module docstring for the route). ``fingerprint``:
    the call's words, carried by its gather stage and its rail exchange and compared after them (hier_agree.py)."""
    rank, R, N, G = comm.rank, comm.world_size, comm.num_nodes, comm.gpus
    dev, H, T = x.device, x.shape[1], handle.num_tokens
    counts = handle.count_matrix.tolist()
    held = [counts[s][rank] for s in range(R)]  # rows we hold for each source, in that order
    begins = [sum(held[:s]) for s in range(R)]
    real = sum(held)  # x may be worst-case sized: rows past the real ones are ignored
    xs = x[:real]
    w = topk_weights[:real] if topk_weights is not None else None
    K = w.shape[1] if w is not None else 0

    # Rows as a holder sends them: x (or e4m3 + scales), weights; over NVLink also the source token index.
    held_parts = (list(per_token_cast_to_fp8(xs)) if use_fp8 else [xs]) + ([w] if w is not None else [])
    held_row_bytes = [part_row_bytes(p) for p in held_parts]
    held_bytes = sum(held_row_bytes)
    held_stride = round_up(held_bytes, 16)            # RDMA row of a token one GPU of the node holds
    partial_stride = round_up(4 * H + 4 * K, 16)      # RDMA row of a node partial: fp32 x and weights
    src_idx = handle.recv_src_idx[:real]
    nvl_parts = held_parts + [src_idx]
    nvl_row_bytes = held_row_bytes + [4]
    nvl_stride = round_up(held_bytes + 4, 16)
    packed = pack_rows(nvl_parts, real, nvl_stride)

    # NVLink hop: our rows for source s go to s's forwarder on our node (the GPU with s's local index).
    with comm.node_hop("combine:gather") as hop:
        if fingerprint is not None:
            hier_agree.put_words(comm, {rank: fingerprint})
        for s in range(R):
            if held[s] and s != rank:
                hop.put(s % G, combine_area_row(comm, counts, s, rank) * nvl_stride,
                        packed[begins[s]:begins[s] + held[s]])

    def as_values(tensors: List[torch.Tensor]):
        """(fp32 x rows, fp32 weight rows or None) of unpacked held parts, dequantized as the reference does."""
        nx = 2 if use_fp8 else 1
        vals = per_token_cast_back(tensors[0], tensors[1]) if use_fp8 else tensors[0].float()
        return vals, (tensors[nx] if w is not None else None)

    if fingerprint is not None and not hier_agree.node_agrees(comm, fingerprint):
        hier_agree.combine_disagreed(comm, fingerprint)  # raises on every rank

    # Node partials for every source of our rail: its tokens our node holds, node ranks ascending, fp32 from +0.
    area = comm.node_area()
    own = None
    blocks = {}
    for m, s in enumerate(comm.rail()):
        pieces = []  # (source token index, fp32 rows, fp32 weights, the rows' bytes as held or None)
        for d in comm.node_ranks():
            n = counts[s][d]
            if n == 0:
                continue
            if d == s:  # our own rows for our own tokens: never quantized, never moved (as in the reference)
                b = begins[s]
                pieces.append((src_idx[b:b + n], xs[b:b + n].float(), w[b:b + n] if w is not None else None, None))
            else:
                o = combine_area_row(comm, counts, s, d) * nvl_stride
                raw = area[o:o + n * nvl_stride].view(n, nvl_stride)
                tensors = unpack_rows(raw, nvl_parts, nvl_row_bytes)
                vals, wv = as_values(tensors)
                pieces.append((tensors[-1], vals, wv, raw))
        src_all = (torch.cat([p[0] for p in pieces]) if pieces
                   else torch.empty(0, dtype=torch.int32, device=dev)).long()
        toks, inverse = torch.unique(src_all, sorted=True, return_inverse=True)
        part = torch.zeros(toks.numel(), H, dtype=torch.float32, device=dev)
        wpart = torch.zeros(toks.numel(), K, dtype=torch.float32, device=dev) if w is not None else None
        at = 0
        for _, vals, wv, _ in pieces:
            pos = inverse[at:at + vals.shape[0]]
            at += vals.shape[0]
            part.index_add_(0, pos, vals)
            if wpart is not None:
                wpart.index_add_(0, pos, wv)
        if s == rank:
            own = (toks, part, wpart)
            continue
        # RDMA block for s: one-holder tokens as held (exact), then several-holder tokens as fp32 partials.
        holders = torch.bincount(inverse, minlength=toks.numel())
        single, multi = (holders == 1).nonzero()[:, 0], (holders > 1).nonzero()[:, 0]
        raw_all = (torch.cat([p[3] for p in pieces]) if pieces
                   else torch.empty(0, nvl_stride, dtype=torch.uint8, device=dev))
        row_of = torch.empty(toks.numel(), dtype=torch.int64, device=dev)
        row_of[inverse] = torch.arange(src_all.numel(), device=dev)  # exact where a token has one holder
        single_rows = torch.zeros(single.numel(), held_stride, dtype=torch.uint8, device=dev)
        single_rows[:, :held_bytes] = raw_all.index_select(0, row_of[single])[:, :held_bytes]
        multi_parts = [part[multi]] + ([wpart[multi]] if wpart is not None else [])
        blocks[m] = [single_rows, pack_rows(multi_parts, multi.numel(), partial_stride)]

    # What each other node's forwarder sends us: our tokens it holds, one-holder ones first, token order.
    holders_per_node = handle.is_token_in_rank.view(T, N, G).sum(dim=2)
    expect, recv_bytes = {}, {}
    for m in comm.other_nodes:
        c = holders_per_node[:, m]
        expect[m] = ((c == 1).nonzero()[:, 0], (c > 1).nonzero()[:, 0])
        recv_bytes[m] = expect[m][0].numel() * held_stride + expect[m][1].numel() * partial_stride
    got = comm.rail_exchange(blocks, recv_bytes, "combine:rdma",
                             header=hier_agree.combine_header(comm, fingerprint) if fingerprint is not None else None)
    if fingerprint is not None:
        hier_agree.combine_check(comm, fingerprint)

    # Sum the node partials, nodes ascending, fp32 from +0; one rounding.
    acc = torch.zeros(T, H, dtype=torch.float32, device=dev)
    wacc = torch.zeros(T, K, dtype=torch.float32, device=dev) if w is not None else None
    fp32_parts = [_template(H, torch.float32, dev)] + ([_template(K, torch.float32, dev)] if w is not None else [])
    for m in range(N):
        if m == comm.node:
            if own is not None:
                toks, part, wpart = own
                acc.index_add_(0, toks, part)
                if wacc is not None:
                    wacc.index_add_(0, toks, wpart)
            continue
        single_t, multi_t = expect[m]
        n1 = single_t.numel()
        block = got[m]
        vals, wv = as_values(unpack_rows(block[:n1 * held_stride].view(n1, held_stride), held_parts, held_row_bytes))
        multi = unpack_rows(block[n1 * held_stride:].view(multi_t.numel(), partial_stride), fp32_parts,
                            [4 * H] + ([4 * K] if w is not None else []))
        acc.index_add_(0, single_t, vals)
        acc.index_add_(0, multi_t, multi[0])
        if wacc is not None:
            wacc.index_add_(0, single_t, wv)
            wacc.index_add_(0, multi_t, multi[1])
    return acc.to(x.dtype), wacc
