// The one description of a rank's low-latency buffer (a second IPC allocation, made at the first low-latency
// call for a given shape). Receive regions are double-buffered by `slot` (the call's parity) so two
// micro-batches can be in flight; flags hold the device-side sequence number, never reset.
//
//   seq_counter  u64   [1]                          our low-latency sequence number
//   count_flag   u64   [R]                          dispatch: rank s wrote its per-expert counts
//   data_flag    u64   [R][kMaxBlocks]              dispatch: block b of rank s wrote its entries
//   comb_flag    u64   [R][kMaxBlocks]              combine: block b of rank r wrote our rows back
//   counts       int32 [2][R][E]                    per slot: entries rank s sends to every expert
//   recv_src     int32 [2][L][R*M]                  per slot: t*K + k of each received entry
//   recv_x       bytes [2][L][R*M][H*2]             per slot: entries (bf16, or e4m3 in the first H bytes)
//   recv_scales  f32   [2][L][R*M][H/128]           per slot: FP8 scales
//   comb_recv    bytes [2][M][K][H*2]               per slot: expert outputs coming back, bf16, by (token, slot)
#pragma once
#include <cstdint>

#include "nvl_layout.hpp"

namespace dc {

struct LlLayout {
  int num_ranks, num_experts, max_tokens, topk_max;
  int64_t hidden;
  int64_t seq_counter, count_flag, data_flag, comb_flag, counts, recv_src, recv_x, recv_scales, comb_recv, total;

  DC_HD int local_experts() const { return num_experts / num_ranks; }
  DC_HD int64_t rows_per_expert() const { return int64_t(num_ranks) * max_tokens; }
  DC_HD int64_t row_bytes() const { return hidden * 2; }

  DC_HD LlLayout(int ranks, int experts, int max_tok, int64_t hidden_, int topk)
      : num_ranks(ranks), num_experts(experts), max_tokens(max_tok), topk_max(topk), hidden(hidden_) {
    const int64_t L = experts / ranks, rows = int64_t(ranks) * max_tok;
    int64_t off = 0;
    seq_counter = off; off = align_up(off + 8, kAlign);
    count_flag = off;  off = align_up(off + int64_t(ranks) * 8, kAlign);
    data_flag = off;   off = align_up(off + int64_t(ranks) * kMaxBlocks * 8, kAlign);
    comb_flag = off;   off = align_up(off + int64_t(ranks) * kMaxBlocks * 8, kAlign);
    counts = off;      off = align_up(off + 2 * int64_t(ranks) * experts * 4, kAlign);
    recv_src = off;    off = align_up(off + 2 * L * rows * 4, kAlign);
    recv_x = off;      off = align_up(off + 2 * L * rows * hidden_ * 2, kAlign);
    recv_scales = off; off = align_up(off + 2 * L * rows * (hidden_ / 128) * 4, kAlign);
    comb_recv = off;   off = align_up(off + 2 * int64_t(max_tok) * topk * hidden_ * 2, kAlign);
    total = off;
  }
  DC_HD int64_t signal_bytes() const { return counts; }

  // Per-slot addresses inside one rank's buffer.
  DC_HD int64_t counts_at(int slot) const { return counts + int64_t(slot) * num_ranks * num_experts * 4; }
  DC_HD int64_t recv_src_at(int slot) const { return recv_src + int64_t(slot) * local_experts() * rows_per_expert() * 4; }
  DC_HD int64_t recv_x_at(int slot) const {
    return recv_x + int64_t(slot) * local_experts() * rows_per_expert() * row_bytes();
  }
  DC_HD int64_t recv_scales_at(int slot) const {
    return recv_scales + int64_t(slot) * local_experts() * rows_per_expert() * (hidden / 128) * 4;
  }
  DC_HD int64_t comb_recv_at(int slot) const { return comb_recv + int64_t(slot) * max_tokens * topk_max * row_bytes(); }
};

}  // namespace dc
