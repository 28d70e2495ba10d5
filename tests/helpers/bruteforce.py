"""Brute-force, loop-per-token versions of the contract in docs/api.md, for comparison in tests.

Inputs of all ranks are lists indexed by rank: xs[s] [T_s, H], idxs[s] [T_s, K], ws[s] [T_s, K].
"""
import torch

from deepcomm.fp8 import per_token_cast_back, per_token_cast_to_fp8


def make_topk(gen, num_tokens, num_slots, num_experts, p_empty=0.2):
    """Distinct experts per token, some slots -1."""
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:num_slots] for _ in range(num_tokens)]) \
        if num_tokens else torch.zeros(0, num_slots, dtype=torch.int64)
    empty = torch.rand(idx.shape, generator=gen) < p_empty
    return torch.where(empty, torch.full_like(idx, -1), idx).contiguous()


def ranks_of(token_idx, num_experts, world):
    per_rank = num_experts // world
    return sorted({int(e) // per_rank for e in token_idx if e >= 0})


def layout(idx, num_experts, world):
    per_rank_count = [0] * world
    per_expert = [0] * num_experts
    in_rank = torch.zeros(idx.shape[0], world, dtype=torch.bool)
    send_pos = torch.full((idx.shape[0], world), -1, dtype=torch.int32)
    for t in range(idx.shape[0]):
        for e in set(idx[t].tolist()):  # a token counts once per expert
            if e >= 0:
                per_expert[e] += 1
        for r in ranks_of(idx[t], num_experts, world):
            in_rank[t, r] = True
            send_pos[t, r] = per_rank_count[r]
            per_rank_count[r] += 1
    return (torch.tensor(per_rank_count, dtype=torch.int32), torch.tensor(per_expert, dtype=torch.int32),
            in_rank, send_pos)


def dispatch(dst, xs, idxs, ws, num_experts, alignment=1):
    """What rank ``dst`` receives: (rows [(src, t)], recv_x rows list, recv_idx, recv_w, counts)."""
    world = len(idxs)
    per_rank = num_experts // world
    rows, local_idx, local_w = [], [], []
    for s in range(world):
        for t in range(idxs[s].shape[0]):
            if dst in ranks_of(idxs[s][t], num_experts, world):
                rows.append((s, t))
                li = [e - dst * per_rank if e >= 0 and e // per_rank == dst else -1 for e in idxs[s][t].tolist()]
                local_idx.append(li)
                if ws is not None:
                    local_w.append([w if l >= 0 else 0.0 for w, l in zip(ws[s][t].tolist(), li)])
    counts = [sum(1 for li in local_idx if e in li) for e in range(per_rank)]
    counts = [(c + alignment - 1) // alignment * alignment for c in counts]
    num_slots = idxs[0].shape[1]
    recv_idx = torch.tensor(local_idx, dtype=torch.int64).reshape(-1, num_slots)
    recv_w = torch.tensor(local_w, dtype=torch.float32).reshape(-1, num_slots) if ws is not None else None
    return rows, recv_idx, recv_w, counts


def gather_rows(rows, tensors):
    """Stack ``tensors[s][t]`` for (s, t) in rows (works for an empty list)."""
    if not rows:
        return tensors[0][:0].clone()
    return torch.stack([tensors[s][t] for s, t in rows])


def combine(src, ys, rows_at, idxs, num_experts, out_dtype, gpus_per_node=None):
    """Rank ``src``'s combined output: per token, the sum of its rows, one rounding. Within each node (ranks
    ascending) first, then the nodes' partials ascending; with one node that is the sum over ranks ascending."""
    world = len(ys)
    gpn = gpus_per_node or world
    acc_dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    out = []
    for t in range(idxs[src].shape[0]):
        acc = torch.zeros(ys[0].shape[1:], dtype=acc_dtype)
        dests = ranks_of(idxs[src][t], num_experts, world)
        for node in range(world // gpn):
            mine = [d for d in dests if d // gpn == node]
            if not mine:
                continue
            part = torch.zeros(ys[0].shape[1:], dtype=acc_dtype)
            for d in mine:
                part = part + ys[d][rows_at[d].index((src, t))].to(acc_dtype)
            acc = acc + part
        out.append(acc.to(out_dtype))
    return torch.stack(out) if out else torch.zeros(0, *ys[0].shape[1:], dtype=out_dtype)


def ll_entries(owner_rank, local_expert, idxs, num_experts):
    """Entries (src, t, k) of one expert at its owner, ordered by source rank, token, slot."""
    world = len(idxs)
    e = owner_rank * (num_experts // world) + local_expert
    return [(s, t, k) for s in range(world) for t in range(idxs[s].shape[0])
            for k in range(idxs[s].shape[1]) if int(idxs[s][t, k]) == e]


def ll_dispatch(dst, xs, idxs, num_experts, max_tokens, use_fp8, use_ue8m0):
    """Expected (payload rows per expert, recv_count, src_info rows, layout) at ``dst``; fp8 payload is a pair."""
    world = len(idxs)
    per_rank = num_experts // world
    casted = [per_token_cast_to_fp8(x, use_ue8m0) for x in xs] if use_fp8 else None
    experts = []
    for e in range(per_rank):
        entries = ll_entries(dst, e, idxs, num_experts)
        if use_fp8:
            payload = (gather_rows([(s, t) for s, t, _ in entries], [c[0] for c in casted]),
                       gather_rows([(s, t) for s, t, _ in entries], [c[1] for c in casted]))
        else:
            payload = gather_rows([(s, t) for s, t, _ in entries], xs)
        layout_rows, begin = [], 0
        for s in range(world):
            n = sum(1 for es, _, _ in entries if es == s)
            layout_rows.append([begin, n])
            begin += n
        experts.append((entries, payload, [t for _, t, _ in entries], layout_rows))
    return experts


def ll_recv_pos(src, idxs, num_experts):
    world = len(idxs)
    per_rank = num_experts // world
    pos = torch.full(idxs[src].shape, -1, dtype=torch.int32)
    for t in range(idxs[src].shape[0]):
        for k in range(idxs[src].shape[1]):
            e = int(idxs[src][t, k])
            if e >= 0:
                pos[t, k] = ll_entries(e // per_rank, e % per_rank, idxs, num_experts).index((src, t, k))
    return pos


def ll_combine(src, ys, idxs, ws, num_experts, use_fp8=False):
    """out[t] = sum over ranks d ascending of (sum over slots k ascending on d of w*y), fp32, one bf16 rounding.
    A partial from another rank is rounded to bf16 before it is added (it crossed the link as bf16); with
    ``use_fp8`` it is quantized per 128 values and dequantized instead."""
    world = len(ys)
    per_rank = num_experts // world
    pos = ll_recv_pos(src, idxs, num_experts)
    hidden = ys[0].shape[-1]
    out = torch.zeros(idxs[src].shape[0], hidden, dtype=torch.bfloat16)
    for t in range(idxs[src].shape[0]):
        acc = torch.zeros(hidden, dtype=torch.float32)
        for d in range(world):
            partial = torch.zeros(hidden, dtype=torch.float32)
            for k in range(idxs[src].shape[1]):
                e = int(idxs[src][t, k])
                if e >= 0 and e // per_rank == d:
                    partial = partial + ws[src][t, k] * ys[d][e % per_rank, pos[t, k]].float()
            if d != src and use_fp8:
                partial = per_token_cast_back(*per_token_cast_to_fp8(partial[None]))[0]
            elif d != src:
                partial = partial.to(torch.bfloat16).float()
            acc = acc + partial
        out[t] = acc.to(torch.bfloat16)
    return out
