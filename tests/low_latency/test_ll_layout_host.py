"""The low-latency buffer layout (csrc/runtime/ll_layout.hpp, through deepcomm._C): everything source rank s writes
into us for one slot lies in one inbox block [slot][s], in the section of its kind (dispatch data | combine data |
dispatch flags | combine flags), at the offsets the kernels use (LlContext.field_at calls the same accessors); the
flags sections hold exactly the per-block arrival words; what must be zeroed when the call numbers restart
(unmask_ranks: reset_signals zeroes [0, signal_bytes)) covers every inbox and outbox (arrival words, bad-input words,
tagged weights); every region fits the total; and the kernels' base for a peer reached by puts maps its stores into
our outbox."""
import pytest

from deepcomm._ext import load_extension

C = load_extension()
pytestmark = pytest.mark.skipif(C is None, reason="deepcomm._C is not built (no nvcc at install time)")
TOPK_MAX = getattr(C, "TOPK_MAX", 0)  # what deepcomm/cuda/ll_buffer.py passes (csrc/kernels/topk_max.hpp)
SHAPES = [(2, 256, 128, 7168), (8, 256, 128, 7168), (4, 32, 1, 2048), (2, 2, 256, 5120)]


def _sizes(experts, max_tokens, hidden):
    """Bytes of each field of one inbox block, and the bytes one kernel store region of it spans (per token /
    per block / per word)."""
    return {"counts": experts * 8, "ntok": 8, "meta": max_tokens * TOPK_MAX * 4, "input_err": 16,
            "stage_x": max_tokens * hidden * 2, "stage_scales": max_tokens * hidden // 128 * 4,
            "weights": max_tokens * TOPK_MAX * 8, "partials": max_tokens * hidden * 2,
            "arrivals_dispatch": C.MAX_BLOCKS * 8, "arrivals_combine": C.MAX_BLOCKS * 8}


ORDER = ["counts", "ntok", "meta", "input_err", "stage_x", "stage_scales", "weights", "partials",
         "arrivals_dispatch", "arrivals_combine"]
# the section (kind, "data" | "flags") each field belongs to
SECTION = {"counts": (0, "data"), "ntok": (0, "data"), "meta": (0, "data"), "input_err": (0, "data"),
           "stage_x": (0, "data"), "stage_scales": (0, "data"), "weights": (1, "data"), "partials": (1, "data"),
           "arrivals_dispatch": (0, "flags"), "arrivals_combine": (1, "flags")}


@pytest.mark.parametrize("ranks,experts,max_tokens,hidden", SHAPES)
@pytest.mark.parametrize("outbox", [False, True])
def test_sections_and_signals(ranks, experts, max_tokens, hidden, outbox):
    lay = C.LlContext(0, ranks, experts, max_tokens, hidden, TOPK_MAX, outbox).layout()
    ib, block = lay["ib"], lay["block"]
    sizes = _sizes(experts, max_tokens, hidden)
    # one inbox block per (slot, source), every field inside it, in the order of its four sections
    assert ib["counts"] == 0
    for a, b in zip(ORDER, ORDER[1:]):
        assert ib[a] + sizes[a] <= ib[b], (a, b, ib)
    assert ib["arrivals_combine"] + sizes["arrivals_combine"] <= lay["put_seq"] and lay["put_seq"] + 16 <= block
    # a call's sections: dispatch data | combine data | dispatch flags | combine flags, back to back; the flags
    # sections are the arrival words (main's only completion signal), the data sections everything else
    (d0, d1), (c0, c1) = lay["data"]
    (f0, f1), (g0, g1) = lay["flags"]
    assert (d0, c0, f0, g0, g1) == (ib["counts"], ib["weights"], ib["arrivals_dispatch"], ib["arrivals_combine"],
                                    lay["put_seq"])
    assert d1 == c0 and c1 == f0 and f1 == g0
    for f, (kind, section) in SECTION.items():
        begin, end = lay[section][kind]
        assert begin <= ib[f] and ib[f] + sizes[f] <= end, (f, lay[section][kind])
    # every section starts aligned (16-byte stores into rows, 8-byte words)
    assert all(x % 256 == 0 for x in (d0, d1, c1, f1, g1, block)), lay
    # inboxes (and outboxes) lie in the signal bytes: call numbers restart from zero after unmasking, and a stale
    # arrival word or tagged weight must never match a restarted call
    assert lay["mask"] < lay["inbox"] and lay["inbox"] + 2 * ranks * block <= lay["signal_bytes"], lay
    assert lay["outbox"] + (2 * ranks * block if outbox else 0) <= lay["signal_bytes"] == lay["entry"], lay
    slots = [lay[k][1] for k in ("recv_x_slot", "out_count_slot", "out_recv_pos_slot")]
    assert all(lay["signal_bytes"] <= s < lay["total"] for s in slots), lay
    # the outbox only adds its own room: every inbox offset is the same with and without it
    other = C.LlContext(0, ranks, experts, max_tokens, hidden, TOPK_MAX, not outbox).layout()
    assert (other["inbox"], other["block"], other["ib"]) == (lay["inbox"], block, ib)
    assert abs(other["total"] - lay["total"]) == 2 * ranks * block


@pytest.mark.parametrize("ranks,experts,max_tokens,hidden", SHAPES)
def test_every_store_of_a_source_lands_in_its_inbox_block(ranks, experts, max_tokens, hidden):
    """The kernels' offsets (the accessors of ll_layout.hpp) for everything source s stores into us: inside
    inbox[slot][s], in the section of its kind, first and last token / block / word alike."""
    ctx = C.LlContext(0, ranks, experts, max_tokens, hidden, TOPK_MAX)
    lay = ctx.layout()
    sizes = _sizes(experts, max_tokens, hidden)
    # per field: the indices the kernels pass (token, block or bad-input word) and the bytes one index spans
    span = {"counts": ([0], experts * 8), "ntok": ([0], 8), "meta": ([0, max_tokens - 1], TOPK_MAX * 4),
            "input_err": ([0, 1], 8), "stage_x": ([0, max_tokens - 1], hidden * 2),
            "stage_scales": ([0, max_tokens - 1], hidden // 128 * 4), "weights": ([0, max_tokens - 1], TOPK_MAX * 8),
            "partials": ([0, max_tokens - 1], hidden * 2), "arrivals_dispatch": ([0, C.MAX_BLOCKS - 1], 8),
            "arrivals_combine": ([0, C.MAX_BLOCKS - 1], 8)}
    assert set(span) == set(sizes)
    for slot in range(2):
        for s in range(ranks):
            block = lay["inbox"] + (slot * ranks + s) * lay["block"]
            for f, (indices, nbytes) in span.items():
                kind, section = SECTION[f]
                begin, end = lay[section][kind]
                for t in indices:
                    at = ctx.field_at(f, slot, s, t)
                    assert block + begin <= at and at + nbytes <= block + end, (f, slot, s, t)
                    assert at % 4 == 0 and (nbytes % 8 or at % 8 == 0), (f, at)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_outbox_base_maps_every_store_for_a_put_peer(ranks):
    """The kernels' base for a put peer d (deepcomm/cuda/ll_buffer.py): base + inbox_at(slot, rank) + f must be
    our outbox_at(slot, d) + f, for both slots, every rank and every d."""
    for rank in range(ranks):
        ctx = C.LlContext(rank, ranks, 64, 16, 2048, TOPK_MAX, True)
        lay = ctx.layout()
        block = lay["block"]
        for d in range(ranks):
            if d == rank:
                continue
            base = lay["outbox"] - lay["inbox"] + (d - rank) * block
            for slot in range(2):
                assert base + lay["inbox"] + (slot * ranks + rank) * block == lay["outbox"] + (slot * ranks + d) * block
                # every field we store into d, through the accessors the kernels use with our own rank
                for f in SECTION:
                    at = base + ctx.field_at(f, slot, rank, 0)
                    out = lay["outbox"] + (slot * ranks + d) * block
                    assert out <= at < out + block, (f, rank, d, slot)


def test_field_at_rejects_unknown_fields():
    ctx = C.LlContext(0, 2, 4, 1, 128, TOPK_MAX)
    with pytest.raises(ValueError):
        ctx.field_at("entry", 0, 0)


def test_the_context_holds_a_peer_for_every_rank_the_internode_path_takes():
    """Low-latency mode spans every rank of the job (internode too): the context's peer table has room for
    LL_MAX_RANKS ranks, as many as the internode path takes (32 nodes x 8 GPUs), and refuses more instead of
    writing past it."""
    n = C.LL_MAX_RANKS
    assert n == C.transport.INTERNODE_MAX_RANKS == 256 and C.MAX_RANKS == 8
    ctx = C.LlContext(n - 1, n, 2 * n, 8, 1024, TOPK_MAX, True)
    for r in range(n):
        ctx.set_peer(r, 0x10000 * (r + 1))
    with pytest.raises(ValueError):
        ctx.set_peer(n, 0x10000)
    with pytest.raises(ValueError, match=f"at most {n} ranks"):
        C.LlContext(0, n + 1, 2 * (n + 1), 8, 1024, TOPK_MAX)
    with pytest.raises(ValueError, match="rank out of range"):
        C.LlContext(4, 4, 8, 8, 1024, TOPK_MAX)


def test_ranks_past_the_inline_peers_need_the_device_peer_table():
    """The kernels take the first LL_INLINE_PEERS bases in their arguments and the rest from a device-memory copy of
    peer_bases(): a launch in a larger job without that copy raises instead of reading a null table, and a later
    set_peer of a far rank drops it until it is given again."""
    n = C.LL_INLINE_PEERS + 8
    ctx = C.LlContext(0, n, 2 * n, 8, 1024, TOPK_MAX)
    bases = [0x10000 * (r + 1) for r in range(n)]
    for r, b in enumerate(bases):
        ctx.set_peer(r, b)
    assert ctx.peer_bases() == bases
    words = [0] * C.FINGERPRINT_WORDS
    with pytest.raises(ValueError, match="peer table in device memory"):
        ctx.agree_reject(words, 0, 0, 0)
    ctx.set_peer_table(0x5000)
    ctx.set_peer(n - 1, 0x9000)
    with pytest.raises(ValueError, match="peer table in device memory"):
        ctx.agree_reject(words, 0, 0, 0)
