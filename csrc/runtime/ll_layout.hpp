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
//   arrivals     u64   [2][2][R][B]        per kind and slot: block b of rank s has completed its stores into us
//                                          for that rank's send number (its slot_calls after the call); a receive
//                                          waits for its own count in every (live rank, block) word. B = kMaxBlocks
//   mask         int32 [R]                 ranks this rank treats as gone (written by the host): nothing is sent
//                                          to them, nothing awaited from them, their experts count as absent
//   input_err    u64   [2][2][R]           per slot: rank s found bad input in its dispatch of that call: [0] ids
//                                          out of range, [1] a duplicate expert in a row; holds the slot's call
//                                          count then (every receiver records it, not only the rank that passed it)
//   weights      u64   [2][R][M][K]        per slot: rank s's combine weights, each tagged with its call:
//                                          (low 32 bits of the combine's sequence number << 32) | f32 bits
//   counts       int32 [2][R][E]           per slot: entries rank s sends to every expert
//   ntok         int32 [2][R]              per slot: tokens rank s dispatched
//   meta         int32 [2][R][M][K]        per slot: for slot k of token t of rank s: (local expert << 16 | entry
//                                          rank among rank s's entries of that expert), -1 when not ours
//   entry        int32 [2][R][M][K]        per slot: where slot k of token t of rank s landed here (le * R*M + its
//                                          packed row), -1 when not ours; written by the dispatch's receive for
//                                          t < ntok[s], read by the combine's send (no bases to rebuild there)
//   stage_x      bytes [2][R][M][H*2]      per slot: rank s's tokens (bf16, or e4m3 in the first H bytes)
//   stage_scales f32   [2][R][M][H/128]    per slot: their FP8 scales
//   recv_x       bytes [2][L][R*M][H*2]    per slot: packed expert rows (the dispatch output)
//   recv_scales  f32   [2][L][R*M][H/128]
//   partials     bytes [2][R][M][H*2]      per slot: rank d's partial sum for each of our tokens, from every other
//                                          rank: bf16 [H] (e4m3 [H] + f32 [H/128] scales with the FP8 combine);
//                                          our own partial is summed where it is used and never stored
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

struct LlLayout {
  int num_ranks, num_experts, max_tokens, topk_max;
  int64_t hidden;
  int64_t seq, slot_seq, slot_calls, done_count, arrivals, mask, input_err, counts, ntok, meta, entry, weights,
      stage_x, stage_scales, recv_x, recv_scales, partials, entry_key, out_count, out_layout, out_src_info,
      out_recv_pos, total;

  DC_HD int local_experts() const { return num_experts / num_ranks; }
  DC_HD int64_t rows_per_expert() const { return int64_t(num_ranks) * max_tokens; }
  DC_HD int64_t row_bytes() const { return hidden * 2; }
  DC_HD int64_t scales_per_row() const { return hidden / 128; }

  DC_HD LlLayout(int ranks, int experts, int max_tok, int64_t hidden_, int topk)
      : num_ranks(ranks), num_experts(experts), max_tokens(max_tok), topk_max(topk), hidden(hidden_) {
    const int64_t R = ranks, L = experts / ranks, M = max_tok, K = topk, rows = R * M;
    int64_t off = 0;
    auto take = [&](int64_t bytes) {
      const int64_t at = off;
      off = align_up(off + bytes, kAlign);
      return at;
    };
    seq = take(2 * 8);
    slot_seq = take(4 * 8);
    slot_calls = take(4 * 8);
    done_count = take(2 * 4);
    arrivals = take(4 * R * kMaxBlocks * 8);
    mask = take(R * 4);
    input_err = take(2 * 2 * R * 8);
    weights = take(2 * R * M * K * 8);  // zeroed with the signals: a stale tag must never match a new call
    counts = take(2 * R * experts * 4);
    ntok = take(2 * R * 4);
    meta = take(2 * R * M * K * 4);
    entry = take(2 * R * M * K * 4);
    stage_x = take(2 * R * M * hidden_ * 2);
    stage_scales = take(2 * R * M * (hidden_ / 128) * 4);
    recv_x = take(2 * L * rows * hidden_ * 2);
    recv_scales = take(2 * L * rows * (hidden_ / 128) * 4);
    partials = take(2 * R * M * hidden_ * 2);
    entry_key = take(2 * M * K * 4);
    out_count = take(2 * L * 4);
    out_layout = take(2 * L * R * 2 * 4);
    out_src_info = take(2 * L * rows * 4);
    out_recv_pos = take(2 * M * K * 4);
    total = off;
  }
  // Bytes that must start zeroed, and are zeroed again when unmasking restarts the call numbers (sequence
  // numbers, counters, flags, and the tagged weights, whose old tags would otherwise match the restarted calls).
  DC_HD int64_t signal_bytes() const { return counts; }

  // which: 0 = ids out of range, 1 = a duplicate expert in a row
  DC_HD int64_t input_err_at(int slot, int which, int s) const {
    return input_err + (int64_t(slot * 2 + which) * num_ranks + s) * 8;
  }
  // the word of block b of rank s, per kind and slot
  DC_HD int64_t arrival_at(int kind, int slot, int s, int b) const {
    return arrivals + ((int64_t(kind * 2 + slot) * num_ranks + s) * kMaxBlocks + b) * 8;
  }

  // Per-slot addresses inside one rank's buffer.
  DC_HD int64_t counts_at(int slot) const { return counts + int64_t(slot) * num_ranks * num_experts * 4; }
  DC_HD int64_t ntok_at(int slot) const { return ntok + int64_t(slot) * num_ranks * 4; }
  // meta / weights of source rank s, token t: K consecutive values
  DC_HD int64_t meta_at(int slot, int s, int t) const {
    return meta + ((int64_t(slot) * num_ranks + s) * max_tokens + t) * topk_max * 4;
  }
  DC_HD int64_t entry_at(int slot, int s, int t) const {
    return entry + ((int64_t(slot) * num_ranks + s) * max_tokens + t) * topk_max * 4;
  }
  DC_HD int64_t weights_at(int slot, int s, int t) const {
    return weights + ((int64_t(slot) * num_ranks + s) * max_tokens + t) * topk_max * 8;
  }
  DC_HD int64_t stage_x_at(int slot, int s, int t) const {
    return stage_x + ((int64_t(slot) * num_ranks + s) * max_tokens + t) * row_bytes();
  }
  DC_HD int64_t stage_scales_at(int slot, int s, int t) const {
    return stage_scales + ((int64_t(slot) * num_ranks + s) * max_tokens + t) * scales_per_row() * 4;
  }
  DC_HD int64_t recv_x_at(int slot) const {
    return recv_x + int64_t(slot) * local_experts() * rows_per_expert() * row_bytes();
  }
  DC_HD int64_t recv_scales_at(int slot) const {
    return recv_scales + int64_t(slot) * local_experts() * rows_per_expert() * scales_per_row() * 4;
  }
  DC_HD int64_t partials_at(int slot, int d, int t) const {
    return partials + ((int64_t(slot) * num_ranks + d) * max_tokens + t) * hidden * 2;
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
