// Launchers: raw device pointers, sizes and a cudaStream_t. No kernel file knows about torch.
// What each launcher promises is written here; the .cu files hold how.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../runtime/agree_record.hpp"
#include "../runtime/dispatch_counts.hpp"
#include "../runtime/error_record.cuh"
#include "../runtime/ll_layout.hpp"
#include "../runtime/nvl_layout.hpp"

namespace dc {

// Base address of every rank's NVLink buffer as mapped in this process (our own included).
struct Peers {
  uint8_t* base[kMaxRanks];
};

// Base of each rank's low-latency buffer as this process reaches it (mapped, or our outbox for a peer reached by
// puts): every rank of the job, not one NVLink domain (kLlMaxRanks, csrc/runtime/ll_layout.hpp). The first
// kLlInlinePeers travel in the kernels' arguments; a job of more ranks also gives `all`, a device-memory copy of the
// whole table, for the ranks past them. Not the whole table inline: that would be 2 KB of arguments in every
// launch of every job, however few its ranks.
constexpr int kLlInlinePeers = 32;
struct LlPeers {
  uint8_t* base[kLlInlinePeers];
  uint8_t* const* all;  // [num_ranks] in device memory; null at kLlInlinePeers ranks or fewer
#ifdef __CUDACC__
  __device__ __forceinline__ uint8_t* at(int r) const {
    return r < kLlInlinePeers ? base[r]
                              : reinterpret_cast<uint8_t*>(__ldg(reinterpret_cast<const unsigned long long*>(all) + r));
  }
#endif
};

// Layout of one routing (no communication, no host sync; kernels/layout.cu).
//   topk_idx int64 [T, K], K <= 32;  out: tokens_per_rank int32 [R], tokens_per_expert int32 [E],
//   is_token_in_rank bool [T, R]. A token counts once per rank and once per expert, however many of its slots
// name them. R <= 64. Ids outside [-1, E) count nowhere; their number goes into the error record (ctx.err, stage
// kStageLayoutInvalidIds, peer = ctx.rank, the count in waited_ns) unless it already holds an error.
struct LayoutArgs {
  const int64_t* topk_idx;  // [T][K]
  int num_tokens, topk, num_experts, num_ranks;
  int* tokens_per_rank;     // [R]
  int* tokens_per_expert;   // [E]
  bool* is_token_in_rank;   // [T][R]
};
void launch_dispatch_layout(const LayoutArgs& args, const WaitCtx& ctx, cudaStream_t stream);

// Layout plus the count exchange over NVLink; the first kernel of a fresh dispatch, which also advances the
// call's sequence number (no bump kernel before it). After it, notify_out holds
//   int32 [R*R] count matrix (row s = tokens rank s sends to each rank), int32 [L] tokens per local expert
// (summed over sources, not aligned), then the number of expert ids outside [-1, E) on all ranks and on ours.
// Such ids are skipped; the caller must not dispatch when any rank had one. host_counts (nullable): the same
// counts for the host, tagged with host_tag (DispatchCounts). send_pos int32 [T, R]: index of t among our tokens
// sent to r, else -1. Every rank calls it for the same call.
struct NotifyArgs {
  const int64_t* topk_idx;  // [T][K]
  int num_tokens, topk, num_experts;
  bool* is_token_in_rank;   // [T][R]
  int* send_pos;            // [T][R]
  int* notify_out;          // [R*R + L + 2]: NotifyOut (runtime/nvl_layout.hpp)
  DispatchCounts* host_counts;  // device view of mapped host memory, or null
  uint64_t host_tag;
  Fingerprint agree;        // this call's words (agree_record.hpp; w[0] == 0: no agreement). They travel with
                            // the counts; on a difference no rank dispatches (host_counts->disagree, else the
                            // AgreeRecord and kStageDisagree) and invalid_count reads non-zero for the payload
  uint64_t* trace = nullptr;  // diagnostics: [kNotifyTraceBlocks][kNotifyTracePoints][2] stamps (notify_trace_points.hpp), or null
};
void launch_notify_dispatch(const NotifyArgs& args, const NvlLayout& layout, const Peers& peers, const WaitCtx& ctx,
                            cudaStream_t stream);
// Normal-mode dispatch over NVLink. Each rank writes the rows of its tokens straight into the output arrays
// of the receiving ranks (zero copy: outputs live in the receivers' arenas, whose offsets and row capacity
// the receivers publish at kernel start). out_block: byte offset in *our* buffer of our output block, carved by
// DispatchOutLayout for out_rows rows ({x, scales, topk_idx, topk_weights, src_idx}; topk ones unused when the
// inputs are null); out_rows < 0: for the rows that really arrive (the count matrix's column), which the block
// must have room for (a fresh dispatch launched before the host knows the count reserves the worst case).
// invalid_count (nullable): when it points at a non-zero count (bad expert ids on some rank, from notify),
// every rank returns at once without moving data (recording kStageInvalidIds when report_invalid; a host that
// reads the counts itself raises instead); it also clears its send_pos and count_matrix, so a combine or
// cached dispatch on the same handle (a replayed graph runs one without a host check in between) moves nothing
// instead of reading rows that never came. Rows past a receiver's capacity (out_rows) are dropped and recorded
// as kStageOverflow (only possible with a worst-case-sized output); their send_pos entries become -1, so a
// combine on the same handle neither sends nor waits for them.
struct DispatchArgs {
  const void* x;              // [T][x_row_bytes]
  const void* scales;         // [T][scale_row_bytes] or null
  const int64_t* topk_idx;    // [T][K] or null (cached re-dispatch)
  const float* topk_weights;  // [T][K] or null
  int* send_pos;              // [T][R]; dropped rows are set to -1
  int* count_matrix;          // [R][R] device copy; cleared with send_pos on bad ids
  const int* invalid_count;   // or null
  bool report_invalid;
  int num_tokens, topk, num_local_experts;
  int64_t x_row_bytes, scale_row_bytes;
  int64_t out_block;          // offset of our output block in our buffer
  int64_t out_rows;           // rows it is carved for, or -1: the rows that arrive
  int* src_idx_copy;          // or null: after every row landed, our src_idx array (its rows) is copied here
  bool advance_seq;           // this kernel starts the call: it advances the call number (a cached dispatch)
  Fingerprint agree;          // a cached dispatch's words (w[0] == 0: none; a fresh one agrees in notify): they
                              // travel with the mailbox, and on a difference no rank moves a row (kStageDisagree)
  // launched right behind this call's notify kernel with programmatic dependent launch (runtime/pdl_launch.hpp):
  // its blocks are resident while notify ends, and start the moment it completes instead of a launch later
  bool after_notify = false;
};
void launch_dispatch(const DispatchArgs& args, int num_blocks, const NvlLayout& layout, const Peers& peers,
                     const WaitCtx& ctx, cudaStream_t stream);
// A fresh dispatch's notify (notify_args) and payload (args) in one launch of num_blocks blocks, where it can be
// (DEEPCOMM_DISPATCH_FUSED on, vector stores, at most num_blocks notify blocks): true if launched, else nothing
// was, and the caller launches the two kernels.
bool launch_dispatch_fused(const NotifyArgs& notify_args, const DispatchArgs& args, int num_blocks,
                           const NvlLayout& layout, const Peers& peers, const WaitCtx& ctx, cudaStream_t stream);

// Normal-mode combine over NVLink: every received row goes back to its source rank (remote rows into the
// source's staging area, flagged per token); each rank then sums, for each of its tokens, the rows from every
// rank that holds it, ranks ascending, in fp32, rounded once to bf16. use_fp8 (hidden % 128 == 0, the same on
// every rank): rows that cross to another rank are cast to e4m3 per 128-element block with an fp32 scale
// (deepcomm/fp8.py's rule) and dequantized at the receiver before the fp32 sum; rows of our own tokens stay bf16.
struct CombineArgs {
  const void* x;              // bf16 [N][H]
  const float* topk_weights;  // [N][K] or null
  const int* recv_src_idx;    // [N]
  const int* count_matrix;    // [R][R]
  const int* send_pos;        // ours: [T][R]
  void* out;                  // bf16 [T][H]
  float* out_weights;         // [T][K] or null
  int num_recv, num_tokens, hidden, topk;  // num_recv: rows of x (a worst-case size is fine; the real count
                                           // comes from count_matrix on the device)
  bool use_fp8;
  Fingerprint agree;          // the call's words (w[0] == 0: none): they travel with combine_ready, and on a
                              // difference no rank moves a row (kStageDisagree)
};
void launch_combine(const CombineArgs& args, int num_blocks, const NvlLayout& layout, const Peers& peers,
                    const WaitCtx& ctx, cudaStream_t stream);

// ---- low-latency mode (csrc/runtime/ll_layout.hpp, csrc/kernels/ll_common.cuh) ----
// Each call runs its send half, its receive half, or both in one kernel (phases: LlPhases in ll_common.cuh,
// 1 = send, 2 = receive, 3 = both; hook mode launches the halves apart).
// Dispatch, send half: each token goes once to every rank holding one of its experts (bf16, or cast to e4m3 +
// fp32 scales inside the kernel), with the per-slot keys the receiver needs. Waits for nothing.
struct LlDispatchArgs {
  const void* x;           // bf16 [T][H]
  const int64_t* topk_idx; // [T][K]; ids outside [-1, E) count as -1 and are reported (stage kStageLlInvalidIds)
  int num_tokens, topk, slot;
  bool use_fp8, use_ue8m0;
  uint64_t* trace;         // diagnostics: [blocks][8] timer stamps (ll_common.cuh), or null
  int pdl;                 // programmatic dependent launch: 0 off, 1 on and early, 2 on (ll_common.cuh ll_gate)
  Fingerprint agree;       // the call's words (w[0] == 0: none), published by the send half ahead of the tagged
                           // counts; the receive half compares them before any row lands in recv_x
};
// Dispatch, receive half: wait for every rank's tokens, fan them out into the packed expert rows recv_x [L][R*M],
// and write the slot's out_count [L], out_layout [L][R][2] (begin, count per source rank), out_src_info [L][R*M]
// (source token, -1 past the count) and out_recv_pos [T][K] (row of each of our entries at its expert); it reads
// slot, topk and use_fp8 of the args.
// args.pdl != 0: launched with programmatic dependent launch (csrc/runtime/pdl_launch.hpp); so is the combine.
void launch_ll_dispatch(const LlDispatchArgs& args, int phases, int num_blocks, const LlLayout& layout,
                        const LlPeers& peers, const WaitCtx& ctx, cudaStream_t stream);

// Combine. x: expert outputs bf16 [L][R*M][H] in the layout of the slot's dispatch; topk_idx/topk_weights: ours.
struct LlCombineArgs {
  const void* x;
  const float* topk_weights;  // [T][K]
  const int64_t* topk_idx;    // [T][K]
  void* out;                  // bf16 [T][H]
  int num_tokens, topk, slot;
  bool use_fp8;               // partials that cross to another rank travel as e4m3 + fp32 scales per 128
  uint64_t* trace;            // diagnostics: [blocks][8] timer stamps (ll_common.cuh), or null
  int pdl;                    // as LlDispatchArgs::pdl
  Fingerprint agree;          // as LlDispatchArgs::agree: published ahead of the weights, compared before any
                              // partial is sent or summed
};
// Send half: publish our weights, wait for everyone's, then send one partial per (token, source rank) (bf16 to
// another rank, fp32 to ourselves). Receive half: out[t] = sum over the ranks holding t's experts, ascending, of
// their partials; fp32, one rounding.
void launch_ll_combine(const LlCombineArgs& args, int phases, int num_blocks, const LlLayout& layout,
                       const LlPeers& peers, const WaitCtx& ctx, cudaStream_t stream);

// Call agreement of a call this rank rejected (agree_reject.cu): it takes part in the call's first exchange
// with its words (REJECTED set) and moves nothing, so every peer stops that call naming it. Normal mode: advances
// the sequence number like the call's first kernel and publishes the words into every peer's agree slot; with
// `compare` it also waits for every peer's words and records a difference, as a call's first exchange would.
void launch_agree_reject(const Fingerprint& words, const NvlLayout& layout, const Peers& peers, const WaitCtx& ctx,
                         cudaStream_t stream, bool compare = false);
// Low-latency mode: a send half of `kind` into `slot` that publishes only the words and advances the call numbers;
// with `compare` it also waits for every live peer's words and records a difference, as a receive half would.
// blocks: the block count of the peers' low-latency launches (a rejected dispatch of a buffer with put peers
// raises that many arrival words at each, so their receive halves reach the words; 0 otherwise).
void launch_ll_agree_reject(const Fingerprint& words, int kind, int slot, const LlLayout& layout, const LlPeers& peers,
                            const WaitCtx& ctx, cudaStream_t stream, bool compare = false, int blocks = 0);
// A buffer with put peers (layout.with_outbox): after launch_ll_agree_reject of the same words, kind and slot, and
// the host's puts of them, a launch that waits for every live rank's words of that send in our inbox blocks and
// records a difference, as a receive half would. Moves nothing and leaves the call numbers as they are.
void launch_ll_agree_compare(const Fingerprint& words, int kind, int slot, const LlLayout& layout, const LlPeers& peers,
                             const WaitCtx& ctx, cudaStream_t stream);

}  // namespace dc
