// The one description of a rank's low-latency buffer (a second IPC allocation, made at the first low-latency
// call for a given shape). Everything a call touches is double-buffered by `slot` (the dispatch's parity) so two
// micro-batches can be in flight; flags hold sequence numbers, never reset.
//
// Dispatch sends each token once per destination rank into that rank's staging rows (no count exchange first);
// the receiver fans the token out to the packed rows of its local experts. Combine sends one partial sum per
// (token, rank) back (bf16 on the wire, summed in fp32) instead of one row per (token, expert).
//
//   seq          u64   [2]                 our latest dispatch / combine sequence number
//   slot_seq     u64   [2][2]              sequence number of the last dispatch / combine send of each slot
//   slot_calls   u64   [2][2]              dispatch / combine sends so far in each slot
//   done_count   u32   [2]                 per kind: blocks of the running send that finished (the last one
//                                          advances the call numbers)
//   mask         int32 [R]                 ranks this rank treats as gone (written by the host): nothing is sent
//                                          to them, nothing awaited from them, their experts count as absent
//   agree        AgreeSlot [2][2][R]       per kind and slot: rank s's call fingerprint, tagged like the kind's
//                                          words (dispatch: the slot's send count; combine: the sequence number);
//                                          compared before any row lands (csrc/runtime/agree_record.hpp). Its
//                                          offset depends on R only, so it is found alike in every rank's layout
//   inbox        block [2][R]              per slot, everything rank s writes into us, contiguous (the unit a
//                                          peer reached by NVSHMEM puts sends; see outbox), in four sections:
//     dispatch data:  counts u64 [E] (entries rank s sends to every expert), ntok u64 (its token count), each
//                     tagged with its call ((low 32 bits of the slot's send count << 32) | value, polled: the
//                     receive knows its expert bases before the rows' arrival words), meta int32 [M][K] (for
//                     slot k of token t: local expert << 16 | entry rank among rank s's entries of that expert,
//                     -1 when not ours), input_err u64 [2] (rank s found bad input in
//                     its dispatch of that call: [0] ids out of range, [1] a duplicate expert in a row; holds the
//                     slot's call count then; every receiver records it, not only the rank that passed it),
//                     agree_dispatch u64 [16] (with put peers: rank s's call words, each tagged like the counts;
//                     compared once the arrivals are in), stage_x bytes [M][H*2] (its tokens: bf16, or e4m3 in the first H bytes), stage_scales f32
//                     [M][H/128] (their FP8 scales)
//     combine data:   weights u64 [M][K] (its combine weights, each tagged with its call: (low 32 bits of the
//                     combine's sequence number << 32) | f32 bits), agree_combine u64 [16] (with put peers: rank s's
//                     call words, tagged like the weights and put with them ahead of the send half, which compares
//                     them before any partial leaves), partials bytes [M][H*2] (rank s's partial sum
//                     for each of our tokens: bf16 [H], or e4m3 [H] + f32 [H/128] scales with the FP8 combine; our
//                     own partial is summed where it is used and never stored)
//     dispatch flags: arrivals u64 [B]    block b of rank s has completed its dispatch stores into us for that
//                                          rank's send number (its slot_calls after the call); a receive waits
//                                          for its own count in every (live rank, block) word. B = kMaxBlocks
//     combine flags:  arrivals u64 [B]    the same for the combine
//     put_seq u64 [2]                      per kind, the signal word of the puts from rank s (counted, never read)
//                                          The arrival words are the only completion signals: everything else a
//                                          source writes is data, read once the arrivals say it is there (the
//                                          tagged counts and weights carry their own call and are polled)
//   outbox       block [2][R]              only for a buffer with peers reached by puts: what we write into put
//                                          peer d lands in our outbox block for d (its kernel-side base is set
//                                          so), and the host puts its data, then its flags, into d's inbox for us
//   entry        int32 [2][R][M][K]        per slot: where slot k of token t of rank s landed here (le * R*M + its
//                                          packed row), -1 when not ours; written by the dispatch's receive for
//                                          t < ntok[s], read by the combine's send (no bases to rebuild there)
//   recv_x       bytes [2][L][R*M][H*2]    per slot: packed expert rows (the dispatch output)
//   recv_scales  f32   [2][L][R*M][H/128]
//   entry_key    int32 [2][M][K]           per slot: our own entries, (expert << 16 | rank among ours), -1 empty
//   out_count    int32 [2][L]              dispatch outputs returned to the caller as views:
//   out_layout   int32 [2][L][R][2]          recv_count, layout (begin, count), src_info, recv_pos
//   out_src_info int32 [2][L][R*M]
//   out_recv_pos int32 [2][M][K]
#pragma once
#include <cstdint>

#include "nvl_layout.hpp"

namespace dc {

enum LlKind : int { kLlDispatch = 0, kLlCombine = 1 };

// Low-latency mode spans every rank of the job, at most 256 (32 nodes x 8 GPUs): the kernels' live-rank set
// (csrc/runtime/rank_set.hpp), their peer table (LlPeers) and a thread per rank in the agreement and the waits.
constexpr int kLlMaxRanks = 256;

struct LlLayout {
  int num_ranks, num_experts, max_tokens, topk_max;
  int64_t hidden;
  bool with_outbox;
  // our own words
  int64_t seq, slot_seq, slot_calls, done_count, mask, agree;
  // inside one inbox block: dispatch data | combine data | dispatch flags | combine flags | put_seq (ib_* offsets,
  // relative to the block's start), and the block's size
  int64_t ib_counts, ib_ntok, ib_meta, ib_input_err, ib_agree_dispatch, ib_stage_x, ib_stage_scales, ib_weights,
      ib_agree_combine, ib_partials, ib_arrivals_dispatch, ib_arrivals_combine, ib_put_seq, block;
  int64_t inbox, outbox, entry, recv_x, recv_scales, entry_key, out_count, out_layout, out_src_info, out_recv_pos,
      total;

  DC_HD int local_experts() const { return num_experts / num_ranks; }
  DC_HD int64_t rows_per_expert() const { return int64_t(num_ranks) * max_tokens; }
  DC_HD int64_t row_bytes() const { return hidden * 2; }
  DC_HD int64_t scales_per_row() const { return hidden / 128; }

  DC_HD LlLayout(int ranks, int experts, int max_tok, int64_t hidden_, int topk, bool outbox_ = false)
      : num_ranks(ranks), num_experts(experts), max_tokens(max_tok), topk_max(topk), hidden(hidden_),
        with_outbox(outbox_) {
    const int64_t R = ranks, L = experts / ranks, M = max_tok, K = topk, rows = R * M;
    int64_t off = 0;
    auto take = [&](int64_t bytes) {
      const int64_t at = off;
      off = align_up(off + bytes, kAlign);
      return at;
    };
    // one inbox block (offsets relative to its start; every field kAlign-aligned, and so is the block size)
    ib_counts = take(int64_t(experts) * 8);
    ib_ntok = take(8);
    ib_meta = take(M * K * 4);
    ib_input_err = take(2 * 8);
    ib_agree_dispatch = take(int64_t(kFingerprintWords) * 8);
    ib_stage_x = take(M * hidden_ * 2);
    ib_stage_scales = take(M * (hidden_ / 128) * 4);
    ib_weights = take(M * K * 8);
    ib_agree_combine = take(int64_t(kFingerprintWords) * 8);
    ib_partials = take(M * hidden_ * 2);
    ib_arrivals_dispatch = take(int64_t(kMaxBlocks) * 8);
    ib_arrivals_combine = take(int64_t(kMaxBlocks) * 8);
    ib_put_seq = take(2 * 8);
    block = off;
    off = 0;
    seq = take(2 * 8);
    slot_seq = take(4 * 8);
    slot_calls = take(4 * 8);
    done_count = take(2 * 4);
    mask = take(R * 4);
    agree = take(2 * 2 * R * kAgreeSlotBytes);
    inbox = take(2 * R * block);
    outbox = take(outbox_ ? 2 * R * block : 0);
    entry = take(2 * R * M * K * 4);
    recv_x = take(2 * L * rows * hidden_ * 2);
    recv_scales = take(2 * L * rows * (hidden_ / 128) * 4);
    entry_key = take(2 * M * K * 4);
    out_count = take(2 * L * 4);
    out_layout = take(2 * L * R * 2 * 4);
    out_src_info = take(2 * L * rows * 4);
    out_recv_pos = take(2 * M * K * 4);
    total = off;
  }
  // Bytes that must start zeroed, and are zeroed again when unmasking restarts the call numbers: our words, and
  // every inbox and outbox block (arrival words, bad-input words, and the tagged weights, whose old tags would
  // otherwise match the restarted calls; the rows in them are zeroed too, which does no harm).
  DC_HD int64_t signal_bytes() const { return entry; }

  // Our agree slots of one kind and slot: [R], rank s's at + s * kAgreeSlotBytes.
  DC_HD int64_t agree_at(int kind, int slot) const {
    return agree + (int64_t(kind) * 2 + slot) * num_ranks * kAgreeSlotBytes;
  }
  // Everything rank s writes into us for one slot: one contiguous block (the unit a put peer sends).
  DC_HD int64_t inbox_at(int slot, int s) const { return inbox + (int64_t(slot) * num_ranks + s) * block; }
  // Our copy of what we write into put peer d for one slot (with_outbox only).
  DC_HD int64_t outbox_at(int slot, int d) const { return outbox + (int64_t(slot) * num_ranks + d) * block; }
  // The sections of a block a put peer sends after a send half of `kind`, [begin, end) relative to the block: the
  // data first, then (after a quiet) the flags, so that a receiver that sees an arrival word sees the data.
  DC_HD int64_t data_begin(int kind) const { return kind == kLlDispatch ? ib_counts : ib_weights; }
  DC_HD int64_t data_end(int kind) const { return kind == kLlDispatch ? ib_weights : ib_arrivals_dispatch; }
  DC_HD int64_t flags_begin(int kind) const {
    return kind == kLlDispatch ? ib_arrivals_dispatch : ib_arrivals_combine;
  }
  DC_HD int64_t flags_end(int kind) const { return kind == kLlDispatch ? ib_arrivals_combine : ib_put_seq; }

  // Rank s's tagged call words of `kind` in our inbox block for `slot` (a buffer with put peers: ll_common.cuh).
  DC_HD int64_t inbox_agree_at(int kind, int slot, int s) const {
    return inbox_at(slot, s) + (kind == kLlDispatch ? ib_agree_dispatch : ib_agree_combine);
  }

  // which: 0 = ids out of range, 1 = a duplicate expert in a row
  DC_HD int64_t input_err_at(int slot, int which, int s) const {
    return inbox_at(slot, s) + ib_input_err + which * 8;
  }
  // the word of block b of rank s, per kind and slot
  DC_HD int64_t arrival_at(int kind, int slot, int s, int b) const {
    return inbox_at(slot, s) + (kind == kLlDispatch ? ib_arrivals_dispatch : ib_arrivals_combine) + int64_t(b) * 8;
  }

  // Per-slot addresses. Rank s's per-expert counts (E tagged words) and token count (one tagged word).
  DC_HD int64_t counts_at(int slot, int s) const { return inbox_at(slot, s) + ib_counts; }
  DC_HD int64_t ntok_at(int slot, int s) const { return inbox_at(slot, s) + ib_ntok; }
  // meta / entry / weights of source rank s, token t: K consecutive values
  DC_HD int64_t meta_at(int slot, int s, int t) const { return inbox_at(slot, s) + ib_meta + int64_t(t) * topk_max * 4; }
  DC_HD int64_t entry_at(int slot, int s, int t) const {
    return entry + ((int64_t(slot) * num_ranks + s) * max_tokens + t) * topk_max * 4;
  }
  DC_HD int64_t weights_at(int slot, int s, int t) const {
    return inbox_at(slot, s) + ib_weights + int64_t(t) * topk_max * 8;
  }
  DC_HD int64_t stage_x_at(int slot, int s, int t) const {
    return inbox_at(slot, s) + ib_stage_x + int64_t(t) * row_bytes();
  }
  DC_HD int64_t stage_scales_at(int slot, int s, int t) const {
    return inbox_at(slot, s) + ib_stage_scales + int64_t(t) * scales_per_row() * 4;
  }
  DC_HD int64_t recv_x_at(int slot) const {
    return recv_x + int64_t(slot) * local_experts() * rows_per_expert() * row_bytes();
  }
  DC_HD int64_t recv_scales_at(int slot) const {
    return recv_scales + int64_t(slot) * local_experts() * rows_per_expert() * scales_per_row() * 4;
  }
  // rank d's partial sum for our token t
  DC_HD int64_t partials_at(int slot, int d, int t) const {
    return inbox_at(slot, d) + ib_partials + int64_t(t) * hidden * 2;
  }
  DC_HD int64_t entry_key_at(int slot) const { return entry_key + int64_t(slot) * max_tokens * topk_max * 4; }
  DC_HD int64_t out_count_at(int slot) const { return out_count + int64_t(slot) * local_experts() * 4; }
  DC_HD int64_t out_layout_at(int slot) const { return out_layout + int64_t(slot) * local_experts() * num_ranks * 8; }
  DC_HD int64_t out_src_info_at(int slot) const {
    return out_src_info + int64_t(slot) * local_experts() * rows_per_expert() * 4;
  }
  DC_HD int64_t out_recv_pos_at(int slot) const { return out_recv_pos + int64_t(slot) * max_tokens * topk_max * 4; }
};

}  // namespace dc
