// The one description of the per-rank NVLink buffer. The host sizes and carves the buffer with it, the
// kernels find their regions with it; nothing else computes these offsets.
//
// Per-rank buffer (every rank maps every peer's buffer through CUDA IPC):
//   notify_counts   int32 [2][R][R + L + 1] row s: tokens rank s sends to each rank, to each of our L experts,
//                                           then rank s's count of invalid expert ids
//                                           (L = num_local_experts is a capacity; a call may use fewer), in the
//                                           half of the call's seq parity (notify_counts_at): a call stopped by bad
//                                           ids has no payload handshake, so a fast rank's next call may write
//                                           its counts before we read this call's
//   seq_counter     u64   [1]               our collective sequence number (only we touch it)
//   notify_work     NotifyWork              the notify kernel's cross-block accumulators (local only; each
//                                           call's last block leaves them zeroed for the next)
//   notify_flag     u64   [R]               seq of the notify round rank s finished writing
//   mailbox         u64   [R][kMailboxWords] dispatch: peer s's seq, the offsets of its output arrays, its row capacity
//   dispatch_done   u64   [R][kMaxBlocks]   dispatch: block b of rank s finished writing into our output
//   combine_ready   u64   [R]               combine: rank s may start writing into our staging rows
//   agree           AgreeSlot [2][R]        call agreement: rank s's fingerprint of the call whose seq has parity p
//                                           (kAgreeSlotBytes each; csrc/runtime/agree_record.hpp)
//   combine_flag    u64   [R][max_chunks]   combine: rank s has stored every row of its received-row chunk c
//                                           (kCombineChunk rows) that belongs to us
//   combine_stage   bytes [R][max_tokens][combine_row_bytes]  rows coming back for our tokens (an FP8 combine
//                                           uses the smaller combine_fp8_row_bytes as its row stride)
//   arena           bytes [arena_bytes]     dispatch outputs (recv_x and friends), handed out by the host
#pragma once
#include <cstdint>

#include "agree_record.hpp"
#include "host_device.hpp"

namespace dc {

constexpr int kMaxRanks = 8;          // one NVLink domain (a node) in this transport
constexpr int kMaxBlocks = 160;       // >= SMs of any GPU we launch on; dispatch keeps one done flag per block
constexpr int kMailboxWords = 8;      // seq, x, scales, topk_idx, topk_weights, src_idx, capacity rows, spare
constexpr int64_t kAlign = 256;
constexpr int kCombineChunk = 8;   // received rows per combine completion flag (one system fence each)
constexpr int kNotifyChunk = 512;  // tokens per notify block (one per thread)

DC_HD int notify_blocks(int num_tokens) { return num_tokens <= 0 ? 1 : (num_tokens + kNotifyChunk - 1) / kNotifyChunk; }

// The notify kernel's accumulators (csrc/kernels/notify.cu): blocks add their counts here, the last block to
// finish (ticket) reads and clears them. Offsets relative to NvlLayout::notify_work:
//   ticket int32 | invalid int32 | dispatch ticket int32 | entry ticket int32 | notify done u64 |
//   chunk ticket int32 | (4 bytes) | expert_acc int32 [R * L] | chunk_count u64 [blocks][R]
// (the dispatch kernel's ticket finds its last block, which copies src_idx for the handle; the entry ticket is
// call_entry.cuh's; notify done is the last call whose notify phase ended in a fused dispatch, dispatch.cu)
struct NotifyWork {
  static constexpr int64_t kDispatchTicket = 8;
  static constexpr int64_t kEntryTicket = 12;  // call_entry.cuh: the blocks that read the call number
  static constexpr int64_t kNotifyDone = 16;   // u64: the last call whose notify phase ended (a fused dispatch)
  static constexpr int64_t kChunkTicket = 24;  // u32: the notify blocks take their chunks of tokens in turn
  // chunk_count: u64 [chunk][rank], the tokens of each chunk to each rank in the low 32 bits, the low 32 bits of
  // the number of the call that wrote it above them (one word: no flag, no fence between count and tag)
  int64_t ticket, invalid, expert_acc, chunk_count, total;
  DC_HD NotifyWork(int ranks, int local_experts, int max_tokens) {
    ticket = 0;
    invalid = 4;
    expert_acc = 32;
    chunk_count = expert_acc + int64_t(ranks) * local_experts * 4;
    total = chunk_count + int64_t(notify_blocks(max_tokens)) * ranks * 8;
  }
};

DC_HD int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Bytes of one combine row: bf16 hidden values, then K fp32 weights, padded to 16 bytes.
DC_HD int64_t combine_row_bytes(int64_t hidden, int64_t topk) { return align_up(hidden * 2 + topk * 4, 16); }
// Bytes of one FP8 combine row (hidden % 128 == 0): e4m3 values, one fp32 scale per 128 values, then K fp32
// weights, padded to 16 bytes. Never more than combine_row_bytes, so the staging area sized for BF16 rows holds
// them at this smaller stride.
DC_HD int64_t combine_fp8_row_bytes(int64_t hidden, int64_t topk) {
  return align_up(hidden + hidden / 128 * 4 + topk * 4, 16);
}
// Chunks of received rows a rank can have (it receives at most R * max_tokens rows).
DC_HD int64_t combine_max_chunks(int ranks, int max_tokens) {
  return (int64_t(ranks) * max_tokens + kCombineChunk - 1) / kCombineChunk;
}

struct NvlLayout {
  int num_ranks, num_local_experts, max_tokens;
  int64_t hidden_max, topk_max, arena_bytes;
  int64_t seq_counter, notify_work, notify_counts, notify_flag, mailbox, dispatch_done, combine_ready, agree, combine_flag, combine_stage, arena,
      total;

  DC_HD NvlLayout(int ranks, int local_experts, int max_tok, int64_t hidden, int64_t topk, int64_t arena_sz)
      : num_ranks(ranks), num_local_experts(local_experts), max_tokens(max_tok), hidden_max(hidden), topk_max(topk),
        arena_bytes(arena_sz) {
    int64_t off = 0;
    seq_counter = off;    off = align_up(off + 8, kAlign);
    notify_work = off;    off = align_up(off + NotifyWork(ranks, local_experts, max_tok).total, kAlign);
    notify_counts = off;  off = align_up(off + 2 * notify_counts_half(), kAlign);
    notify_flag = off;    off = align_up(off + int64_t(ranks) * 8, kAlign);
    mailbox = off;        off = align_up(off + int64_t(ranks) * kMailboxWords * 8, kAlign);
    dispatch_done = off;  off = align_up(off + int64_t(ranks) * kMaxBlocks * 8, kAlign);
    combine_ready = off;  off = align_up(off + int64_t(ranks) * 8, kAlign);
    agree = off;          off = align_up(off + 2 * int64_t(ranks) * kAgreeSlotBytes, kAlign);
    combine_flag = off;   off = align_up(off + int64_t(ranks) * combine_max_chunks(ranks, max_tok) * 8, kAlign);
    combine_stage = off;  off = align_up(off + int64_t(ranks) * max_tok * combine_row_bytes(hidden, topk), kAlign);
    arena = off;          off = align_up(off + arena_sz, kAlign);
    total = off;
  }
  // Bytes of one half of notify_counts.
  DC_HD int64_t notify_counts_half() const { return int64_t(num_ranks) * (num_ranks + num_local_experts + 1) * 4; }
  // The half of notify_counts the call with sequence number seq uses.
  DC_HD int64_t notify_counts_at(uint64_t seq) const { return notify_counts + int64_t(seq & 1) * notify_counts_half(); }
  // Our slots of the call with sequence number seq: [R] of them, rank s's at + s * kAgreeSlotBytes.
  DC_HD int64_t agree_at(uint64_t seq) const { return agree + int64_t(seq & 1) * num_ranks * kAgreeSlotBytes; }
  // Everything before the combine staging holds flags and must start zeroed.
  DC_HD int64_t signal_bytes() const { return combine_stage; }
};

// Carving of one dispatch output block (in the arena) for N rows. A fresh dispatch reserves a block for the
// worst case and its kernel carves it for the rows that really arrive (the count it learns from notify), so the
// host need not wait for the count before the launch; the host carves the same way once it knows N.
//   x [N][x_row_bytes] | scales [N][scale_row_bytes] | topk_idx int64 [N][K] | topk_weights f32 [N][K] | src_idx int32 [N]
struct DispatchOutLayout {
  int64_t x, scales, topk_idx, topk_weights, src_idx, total;
  DC_HD DispatchOutLayout(int64_t n, int64_t x_row_bytes, int64_t scale_row_bytes, int64_t topk) {
    int64_t off = 0;
    x = off;            off = align_up(off + n * x_row_bytes, kAlign);
    scales = off;       off = align_up(off + n * scale_row_bytes, kAlign);
    topk_idx = off;     off = align_up(off + n * topk * 8, kAlign);
    topk_weights = off; off = align_up(off + n * topk * 4, kAlign);
    src_idx = off;      off = align_up(off + n * 4, kAlign);
    total = off;
  }
};


// The notify kernel's results for a fresh dispatch (NotifyArgs::notify_out), in int32 elements:
//   count_matrix [R][R] (row s: tokens rank s sends to each rank) | tokens per local expert [L] (summed over
//   sources, not aligned) | expert ids outside [-1, E) on all ranks (-1: the ranks' calls differ) | on ours
struct NotifyOut {
  int64_t count_matrix, per_expert, bad_all, bad_mine, total;
  DC_HD NotifyOut(int ranks, int local_experts)
      : count_matrix(0), per_expert(int64_t(ranks) * ranks), bad_all(per_expert + local_experts),
        bad_mine(bad_all + 1), total(bad_mine + 1) {}
};

// A fresh dispatch's workspace: one int32 allocation the host makes per call (deepcomm/nvlink/backend.py), which
// the handle's routing tensors view. Offsets in int32 elements; every part starts at a multiple of 16 bytes
// (compiled graphs, e.g. inductor, assume aligned operator outputs):
//   send_pos [T][R] | notify_out (NotifyOut; count_matrix, per_expert and bad_all are its parts, offset here) |
//   the handle's src_idx copy [rows it can receive] | is_token_in_rank bool [T][R] (bytes from 4 * in_rank)
struct FreshDispatchWork {
  int64_t send_pos, notify_out, count_matrix, per_expert, bad_all, src_idx, in_rank, total;
  DC_HD FreshDispatchWork(int64_t tokens, int ranks, int local_experts, int64_t rows) {
    const NotifyOut n(ranks, local_experts);
    send_pos = 0;
    notify_out = align_up(tokens * ranks, 4);
    count_matrix = notify_out + n.count_matrix;
    per_expert = notify_out + n.per_expert;
    bad_all = notify_out + n.bad_all;
    src_idx = align_up(notify_out + n.total, 4);
    in_rank = align_up(src_idx + rows, 4);
    total = in_rank + (tokens * ranks + 3) / 4;  // is_token_in_rank's T * R bytes, in whole int32 elements
  }
};

}  // namespace dc
