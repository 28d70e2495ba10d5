// Normal-mode dispatch over NVLink, zero copy: each warp takes a token, reads its row once and stores it
// straight into the output arrays of every rank that needs it (remote ranks through peer pointers).
//
// Protocol (seq = the collective's number, the same on every rank):
//   1. block 0 publishes our output offsets in every peer's mailbox[rank] (release on the seq word);
//   2. every block reads the peers' offsets from our mailbox (acquire), then copies its tokens;
//   3. each block raises dispatch_done[rank][block] at every peer, then waits for the same flag of every peer,
//      so when the kernel ends all rows addressed to us have landed.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>

#include "../runtime/call_entry.cuh"
#include "../runtime/pdl_launch.hpp"
#include "../runtime/smem_opt_in.hpp"
#include "../runtime/tuning.hpp"
#include "../runtime/cuda_check.hpp"
#include "../runtime/wait.cuh"
#include "agree.cuh"
#include "api.hpp"
#include "block_flags.cuh"
#include "bulk_rows.cuh"
#include "notify_phase.cuh"

namespace dc {

constexpr int kDispatchThreads = 512;
// the fused launch runs the notify phase in these blocks: one token per thread, as notify's own launch
static_assert(kDispatchThreads == notify_detail::kNotifyThreads, "fused dispatch: notify phase block size");
constexpr int kDispatchUnroll = 8;  // the default: 16-byte vectors each lane holds in flight per dest pass

struct DispatchShared {
  uint8_t* dst[kMaxRanks][5];  // per rank: x, scales, topk_idx, topk_weights, src_idx output arrays
  int row_base[kMaxRanks];     // first row of our tokens in rank d's output
  int64_t capacity[kMaxRanks]; // rows rank d's output holds
  int ok;
};

__device__ __forceinline__ void copy_row_to_dests(const int4* src, int64_t n16, uint8_t* const* dst_rows,
                                                  const int* pos, int num_ranks, int lane) {
  for (int64_t base = lane; base < n16; base += 32 * kDispatchUnroll) {
    int4 v[kDispatchUnroll];
#pragma unroll
    for (int u = 0; u < kDispatchUnroll; ++u) {
      const int64_t i = base + u * 32;
      if (i < n16) v[u] = ptx::ld_nc_na_v4(src + i);
    }
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) {
      if (d >= num_ranks || pos[d] < 0) continue;
      int4* out = reinterpret_cast<int4*>(dst_rows[d]);
#pragma unroll
      for (int u = 0; u < kDispatchUnroll; ++u) {
        const int64_t i = base + u * 32;
        if (i < n16) ptx::st_na_v4(out + i, v[u]);
      }
    }
  }
}

// The tuning variants' token loop (launch_dispatch: DEEPCOMM_DISPATCH_UNROLL, DEEPCOMM_DISPATCH_PREFETCH), the
// same rows and metadata as the default loop in dispatch_kernel. To leave registers for kUnroll vectors per lane,
// a token's destinations are spread over the lanes (lane d < R: its row in rank d's output, or null) and shuffled
// to every lane per destination instead of held by each lane. kPrefetch: the warp loads its next token's send
// positions, expert ids, weights and (up to 64 per row) scales while it copies the current one, so that only the
// row's own loads stand between two tokens.
template <int kUnroll, bool kPrefetch>
__device__ __forceinline__ void dispatch_tokens_lane_dests(const DispatchArgs& a, const DispatchShared& sh,
                                                           const WaitCtx& ctx, int R, int first_token,
                                                           int total_warps, int lane) {
  const int K = a.topk, L = a.num_local_experts;
  const int64_t n16 = a.x_row_bytes / 16, nscale = a.scale_row_bytes / 4;
  const bool scales_ahead = kPrefetch && a.scales != nullptr && nscale <= 64;
  // the next token's metadata (kPrefetch), as the lanes hold it in the loop below
  int ahead_pos = -1, ahead_scale0 = 0, ahead_scale1 = 0;
  int64_t ahead_e = -1;
  float ahead_w = 0.0f;
  const auto load_ahead = [&](int t) {
    if (t >= a.num_tokens) return;
    ahead_pos = lane < R ? a.send_pos[int64_t(t) * R + lane] : -1;
    if (lane < K) {
      if (a.topk_idx != nullptr) ahead_e = a.topk_idx[int64_t(t) * K + lane];
      if (a.topk_weights != nullptr) ahead_w = a.topk_weights[int64_t(t) * K + lane];
    }
    if (scales_ahead) {
      const auto* s = reinterpret_cast<const int*>(static_cast<const uint8_t*>(a.scales) + t * a.scale_row_bytes);
      if (lane < nscale) ahead_scale0 = __ldg(s + lane);
      if (lane + 32 < nscale) ahead_scale1 = __ldg(s + lane + 32);
    }
  };
  if constexpr (kPrefetch) load_ahead(first_token);
  for (int t = first_token; t < a.num_tokens; t += total_warps) {
    int my_pos;
    const int64_t my_e = ahead_e;
    const float my_w = ahead_w;
    const int my_scale0 = ahead_scale0, my_scale1 = ahead_scale1;
    if constexpr (kPrefetch) {
      my_pos = ahead_pos;
      load_ahead(t + total_warps);
    } else {
      my_pos = lane < R ? a.send_pos[int64_t(t) * R + lane] : -1;
    }
    // lane d < R: our row in rank d's output, or -1 (not sent, or past its capacity: dropped and recorded)
    int my_row = -1;
    if (lane < R && my_pos >= 0) {
      my_row = sh.row_base[lane] + my_pos;
      if (my_row >= sh.capacity[lane]) {
        report_input_error(ctx, lane, kStageOverflow);
        a.send_pos[int64_t(t) * R + lane] = -1;  // the combine skips it: no row comes back for it
        my_row = -1;
      }
    }
    uint8_t* my_dst = my_row >= 0 ? sh.dst[lane][0] + int64_t(my_row) * a.x_row_bytes : nullptr;
    const int4* src = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(a.x) + int64_t(t) * a.x_row_bytes);
    // The bound is the warp's, not the lane's: every lane must reach the shuffles below, also where the row's last
    // pass holds fewer than 32 vectors (x rows under 512 bytes, or n16 % (32 * kUnroll) under 32).
    for (int64_t first = 0; first < n16; first += 32 * kUnroll) {
      const int64_t base = first + lane;
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * 32;
        if (i < n16) v[u] = ptx::ld_nc_na_v4(src + i);
      }
#pragma unroll 1
      for (int d = 0; d < R; ++d) {
        int4* out = reinterpret_cast<int4*>(__shfl_sync(0xffffffffu, reinterpret_cast<uintptr_t>(my_dst), d));
        if (out == nullptr) continue;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = base + u * 32;
          if (i < n16) ptx::st_na_v4(out + i, v[u]);
        }
      }
    }
#pragma unroll 1
    for (int d = 0; d < R; ++d) {
      const int64_t row = __shfl_sync(0xffffffffu, my_row, d);
      if (row < 0) continue;
      if (scales_ahead) {
        auto* o = reinterpret_cast<int*>(sh.dst[d][1] + row * a.scale_row_bytes);
        if (lane < nscale) o[lane] = my_scale0;
        if (lane + 32 < nscale) o[lane + 32] = my_scale1;
      } else if (a.scales != nullptr) {
        const auto* s = reinterpret_cast<const int*>(static_cast<const uint8_t*>(a.scales) + t * a.scale_row_bytes);
        auto* o = reinterpret_cast<int*>(sh.dst[d][1] + row * a.scale_row_bytes);
        for (int64_t i = lane; i < nscale; i += 32) o[i] = __ldg(s + i);
      }
      if (lane < K) {
        const int64_t e = kPrefetch ? my_e : a.topk_idx != nullptr ? a.topk_idx[int64_t(t) * K + lane] : -1;
        const bool local = e >= int64_t(d) * L && e < int64_t(d + 1) * L;
        if (a.topk_idx != nullptr)
          reinterpret_cast<int64_t*>(sh.dst[d][2])[row * K + lane] = local ? e - int64_t(d) * L : -1;
        if (a.topk_weights != nullptr) {
          // Cached re-dispatch has no ids: weights then pass through unmasked.
          const float w = kPrefetch ? my_w : a.topk_weights[int64_t(t) * K + lane];
          reinterpret_cast<float*>(sh.dst[d][3])[row * K + lane] = (a.topk_idx == nullptr || local) ? w : 0.0f;
        }
      }
      if (lane == 0) reinterpret_cast<int*>(sh.dst[d][4])[row] = t;
    }
  }
}

// The handle's src_idx copy is made by the last of a call's P payload blocks to take a ticket (dispatch_payload).
// Every block takes one however it leaves (a timed-out wait, a stopped call; in the fused kernel some blocks may
// time out before the payload while the others stop inside it), so that the count is back at 0 for the next call
// (a Buffer goes on after a timeout once the lost peer is masked and unmasked). Thread 0; true for the last block.
__device__ __forceinline__ bool take_src_idx_ticket(uint8_t* self, const NvlLayout& layout, int P) {
  ptx::fence_acq_rel_gpu();
  auto* ticket = reinterpret_cast<uint32_t*>(self + layout.notify_work + NotifyWork::kDispatchTicket);
  const bool last = ptx::atom_add_release_gpu_u32(ticket, 1u) == uint32_t(P - 1);
  if (last) {
    *ticket = 0u;
    ptx::fence_acq_rel_gpu();
  }
  return last;
}

// kBulk: x rows go through shared memory by bulk copies (bulk_rows.cuh), each warp's lane 0 issuing them, with
// kBulkStages chunks per warp in dynamic shared memory; else (the default) every lane copies 16-byte vectors
// (copy_row_to_dests); kUnroll != kDispatchUnroll or kPrefetch: the tuning variants' loop instead
// (dispatch_tokens_lane_dests).
// The payload of a dispatch in blocks 0..P-1 of the grid (P: the payload blocks; every rank runs the same P), with
// the call's number in ctx.
template <bool kBulk, int kUnroll, bool kPrefetch>
__device__ __forceinline__ void dispatch_payload(const DispatchArgs& a, const NvlLayout& layout, const Peers& peers,
                                                 const WaitCtx& ctx, int P) {
  uint8_t* self = peers.base[ctx.rank];
  __shared__ DispatchShared sh;
  const int R = layout.num_ranks, rank = ctx.rank, tid = threadIdx.x, lane = tid & 31;
  // A block that leaves before the end still takes its src_idx ticket (take_src_idx_ticket).
  const auto leave_early = [&] {
    if (a.src_idx_copy != nullptr && tid == 0) take_src_idx_ticket(self, layout, P);
  };
  // Bad expert ids anywhere: every rank sees the same count (from notify) and stops before any handshake. The
  // route is cleared, so whatever runs next on this handle (a combine in the same graph) moves nothing.
  if (a.invalid_count != nullptr && *a.invalid_count != 0) {
    if (a.report_invalid && blockIdx.x == 0 && tid == 0) report_input_error(ctx, -1, kStageInvalidIds);
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + tid; i < int64_t(a.num_tokens) * R;
         i += int64_t(P) * blockDim.x)
      a.send_pos[i] = -1;
    if (blockIdx.x == 0 && tid < R * R) a.count_matrix[tid] = 0;
    leave_early();
    return;
  }
  if (tid == 0) sh.ok = 1;

  if (blockIdx.x == 0 && tid < R) {
    // Our output block carved for its rows: a fixed count, or the rows that arrive (column `rank` of the counts).
    int64_t rows = a.out_rows;
    if (rows < 0) {
      rows = 0;
      for (int s = 0; s < R; ++s) rows += a.count_matrix[s * R + rank];
    }
    const DispatchOutLayout out(rows, a.x_row_bytes, a.scale_row_bytes, a.topk);
    const int64_t offsets[5] = {out.x, out.scales, out.topk_idx, out.topk_weights, out.src_idx};
    auto* box = reinterpret_cast<uint64_t*>(peers.base[tid] + layout.mailbox) + rank * kMailboxWords;
    // a cached dispatch's words go with the mailbox, one fence releasing both
    uint64_t* words_tag =
        agree_on(a.agree)
            ? agree_store_words(peers.base[tid] + layout.agree_at(ctx.seq) + int64_t(rank) * kAgreeSlotBytes, a.agree)
            : nullptr;
    for (int j = 0; j < 5; ++j) box[1 + j] = uint64_t(a.out_block + offsets[j]);
    box[6] = uint64_t(rows);
    release_words_and_flag(words_tag, box, ctx.seq);
  }
  __syncthreads();
  // Every block compares every rank's words before it uses a mailbox: on a difference (or a rank that rejected
  // its call and sent only its words) no rank moves a row, and the handle stays as it was.
  if (agree_on(a.agree) && agree_block(self + layout.agree_at(ctx.seq), a.agree, ctx.seq, R, AllRanks{}, ctx,
                                       kStageAgree, true).status != 1) {
    leave_early();
    return;
  }
  if (tid < R) {
    const auto* box = reinterpret_cast<const uint64_t*>(self + layout.mailbox) + tid * kMailboxWords;
    if (wait_flag_geq(box, ctx.seq, ctx, tid, kStageDispatchMailbox)) {
      for (int j = 0; j < 5; ++j) sh.dst[tid][j] = peers.base[tid] + ptx::ld_relaxed_sys_u64(box + 1 + j);
      sh.capacity[tid] = int64_t(ptx::ld_relaxed_sys_u64(box + 6));
    } else {
      sh.ok = 0;
    }
    int base = 0;
    for (int s = 0; s < rank; ++s) base += a.count_matrix[s * R + tid];
    sh.row_base[tid] = base;
  }
  __syncthreads();
  if (!sh.ok) {  // a mailbox wait timed out (recorded): nothing moves
    leave_early();
    return;
  }
  // Rows some receiver cannot hold (worst-case output too small): every rank has the whole count matrix and every
  // capacity, so every rank records it, not only the senders whose rows are dropped.
  if (blockIdx.x == 0 && tid < R) {
    int arriving = 0;
    for (int s = 0; s < R; ++s) arriving += a.count_matrix[s * R + tid];
    if (arriving > sh.capacity[tid]) report_input_error(ctx, tid, kStageOverflow);
  }

  const int K = a.topk, L = a.num_local_experts;
  const int64_t n16 = a.x_row_bytes / 16, nscale = a.scale_row_bytes / 4;
  const int warps_per_block = kDispatchThreads / 32;
  const int total_warps = P * warps_per_block;
  const int first_token = blockIdx.x * warps_per_block + (tid >> 5);
  extern __shared__ __align__(128) uint8_t bulk_smem[];
  __shared__ uint64_t bulk_bars[kBulk ? kDispatchThreads / 32 : 1][kBulkStages];
  BulkRowPipe pipe;  // lane 0's
  if constexpr (kBulk) {
    if (lane == 0)
      pipe.start(bulk_smem + (tid >> 5) * BulkChunking(a.x_row_bytes).warp_smem(), bulk_bars[tid >> 5], a.x,
                 a.x_row_bytes, first_token, total_warps, a.num_tokens);
  }
  constexpr bool kVariant = !kBulk && (kUnroll != kDispatchUnroll || kPrefetch);
  if constexpr (kVariant) dispatch_tokens_lane_dests<kUnroll, kPrefetch>(a, sh, ctx, R, first_token, total_warps, lane);
  for (int t = first_token; !kVariant && t < a.num_tokens; t += total_warps) {
    const int my_pos = lane < R ? a.send_pos[int64_t(t) * R + lane] : -1;
    int pos[kMaxRanks];
    uint8_t* rows[kMaxRanks];
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) {
      pos[d] = __shfl_sync(0xffffffffu, my_pos, d);
      if (d < R && pos[d] >= 0 && sh.row_base[d] + pos[d] >= sh.capacity[d]) {
        if (lane == 0) {
          report_input_error(ctx, d, kStageOverflow);
          a.send_pos[int64_t(t) * R + d] = -1;  // the combine skips it: no row comes back for it
        }
        pos[d] = -1;
      }
      const int row = d < R ? sh.row_base[d] + pos[d] : 0;
      rows[d] = d < R ? sh.dst[d][0] + int64_t(row) * a.x_row_bytes : nullptr;
    }
    if constexpr (kBulk) {
      if (lane == 0) {
        uint8_t* dst[kMaxRanks];
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) dst[d] = d < R && pos[d] >= 0 ? rows[d] : nullptr;
        pipe.store_row<kMaxRanks>(dst, R);
      }
    } else {
      copy_row_to_dests(reinterpret_cast<const int4*>(static_cast<const uint8_t*>(a.x) + int64_t(t) * a.x_row_bytes),
                        n16, rows, pos, R, lane);
    }
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) {
      if (d >= R || pos[d] < 0) continue;
      const int64_t row = sh.row_base[d] + pos[d];
      if (a.scales != nullptr) {
        const auto* s = reinterpret_cast<const int*>(static_cast<const uint8_t*>(a.scales) + t * a.scale_row_bytes);
        auto* o = reinterpret_cast<int*>(sh.dst[d][1] + row * a.scale_row_bytes);
        for (int64_t i = lane; i < nscale; i += 32) o[i] = __ldg(s + i);
      }
      if (lane < K) {
        const int64_t e = a.topk_idx != nullptr ? a.topk_idx[int64_t(t) * K + lane] : -1;
        const bool local = e >= int64_t(d) * L && e < int64_t(d + 1) * L;
        if (a.topk_idx != nullptr)
          reinterpret_cast<int64_t*>(sh.dst[d][2])[row * K + lane] = local ? e - int64_t(d) * L : -1;
        if (a.topk_weights != nullptr) {
          // Cached re-dispatch has no ids: weights then pass through unmasked.
          const float w = a.topk_weights[int64_t(t) * K + lane];
          reinterpret_cast<float*>(sh.dst[d][3])[row * K + lane] = (a.topk_idx == nullptr || local) ? w : 0.0f;
        }
      }
      if (lane == 0) reinterpret_cast<int*>(sh.dst[d][4])[row] = t;
    }
  }

  if constexpr (kBulk) {
    if (lane == 0) pipe.finish();  // our rows' stores performed before the block raises its done flag below
  }

  // A fixed-size output (num_worst_tokens, or a cached dispatch of such a handle): the rows past the ones that
  // arrive are padding, marked as the reference backend marks them (expert -1, weight 0, source -1). Only this
  // rank writes them: no peer's row lands past the arriving count.
  if (a.out_rows >= 0) {
    int64_t arriving = 0;
    for (int s = 0; s < R; ++s) arriving += a.count_matrix[s * R + rank];
    const int64_t pad_rows = sh.capacity[rank] - arriving;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + tid; i < pad_rows * (K + 1);
         i += int64_t(P) * blockDim.x) {
      const int64_t row = arriving + i / (K + 1);
      const int k = int(i % (K + 1));
      if (k == K) {
        reinterpret_cast<int*>(sh.dst[rank][4])[row] = -1;
        continue;
      }
      if (a.topk_idx != nullptr) reinterpret_cast<int64_t*>(sh.dst[rank][2])[row * K + k] = -1;
      if (a.topk_weights != nullptr) reinterpret_cast<float*>(sh.dst[rank][3])[row * K + k] = 0.0f;
    }
  }

  __syncthreads();
  signal_block_done(peers, layout.dispatch_done, R, ctx);
  if (tid < R) {
    const auto* done = reinterpret_cast<const uint64_t*>(self + layout.dispatch_done);
    if (!wait_flag_geq(done + tid * kMaxBlocks + blockIdx.x, ctx.seq, ctx, tid, kStageDispatchDone)) sh.ok = 0;
  }
  if (a.src_idx_copy == nullptr) return;
  // The handle's copy of our src_idx (so that it does not pin the output block): once every block has seen its
  // peers' rows land, the last block to get here copies the array.
  __syncthreads();
  __shared__ int last;
  if (tid == 0) last = take_src_idx_ticket(self, layout, P) && sh.ok;  // not after a timed-out wait (recorded)
  __syncthreads();
  if (!last) return;
  const int* src = reinterpret_cast<const int*>(sh.dst[rank][4]);
  for (int64_t i = tid; i < sh.capacity[rank]; i += blockDim.x) a.src_idx_copy[i] = __ldcg(src + i);
}

template <bool kBulk, int kUnroll = kDispatchUnroll, bool kPrefetch = false>
__global__ void __launch_bounds__(kDispatchThreads, 1)
    dispatch_kernel(DispatchArgs a, NvlLayout layout, Peers peers, WaitCtx ctx_in) {
  // Behind notify (after_notify): everything below reads what notify wrote, so first wait for it to complete
  // (a no-op for a launch without programmatic dependent launch).
  ptx::grid_dependency_wait();
  uint8_t* self = peers.base[ctx_in.rank];
  // A fresh dispatch's number was advanced by notify; a cached one starts here.
  const WaitCtx ctx = a.advance_seq
      ? enter_call(ctx_in, reinterpret_cast<uint32_t*>(self + layout.notify_work + NotifyWork::kEntryTicket))
      : ctx_in.resolved();
  dispatch_payload<kBulk, kUnroll, kPrefetch>(a, layout, peers, ctx, int(gridDim.x));
}

// A fresh dispatch in one launch (DEEPCOMM_DISPATCH_FUSED=1; not the default: on one H200 at world size 1 it took
// the same host time per call as the two launches, its counts coming later by what the launch saves, and about
// 2 us more GPU time at 4096 tokens, docs/tuning.md): the notify phase in blocks 0..notify_blocks(T)-1
// (notify_phase.cuh), then the payload in every block, once the notify phase's last block has released
// NotifyWork::kNotifyDone for this call (the counts the payload reads written, or the call stopped: the payload
// then sees the invalid count it set and stops too). The call's number advances by entry tickets (call_entry.cuh):
// the other blocks take theirs at entry, the notify blocks after their phase, so that the counts do not wait for a
// ticket's round trip. The host launches it only where the notify blocks are at most the payload blocks, all of
// them resident (num_sms <= the SMs), so the blocks that wait never keep the last notify block out.
template <int kUnroll, bool kPrefetch>
__global__ void __launch_bounds__(kDispatchThreads, 1)
    dispatch_fused_kernel(NotifyArgs na, DispatchArgs a, NvlLayout layout, Peers peers, WaitCtx ctx_in) {
  uint8_t* self = peers.base[ctx_in.rank];
  uint8_t* work = self + layout.notify_work;
  auto* ticket = reinterpret_cast<uint32_t*>(work + NotifyWork::kEntryTicket);
  auto* done = reinterpret_cast<uint64_t*>(work + NotifyWork::kNotifyDone);
  const int G = notify_blocks(na.num_tokens);
  WaitCtx ctx = ctx_in;
  if (int(blockIdx.x) < G) {
    // the counts out: notify_phase released `done` before it wrote the host's counts
    uint64_t seq = 0;
    const notify_detail::NotifyEnd end = notify_detail::notify_phase(na, layout, peers, ctx_in, G, true, seq, done);
    ctx.seq = seq;
    __syncthreads();  // every thread's stores before the release, and the phase's shared words read
    if (threadIdx.x == 0) {
      if (end == notify_detail::kNotifyStopped) {
        *const_cast<int*>(a.invalid_count) = -1;  // nothing moves
        ptx::fence_acq_rel_gpu();
        ptx::st_release_gpu_u64(done, seq);
      }
      take_entry_ticket(ctx_in, ticket, seq);
    }
  } else {
    ctx = enter_call(ctx_in, ticket);
  }
  // Twice the peers' timeout: a peer that never comes is reported by the notify phase's wait (naming it), which
  // then releases the flag, before this wait gives up
  WaitCtx longer = ctx;
  longer.timeout_ns = ctx.timeout_ns * 2;
  __shared__ int ready;
  if (threadIdx.x == 0) ready = wait_flag_geq(done, ctx.seq, longer, ctx.rank, kStageNotifyLocal) ? 1 : 0;
  __syncthreads();
  if (!ready) {  // timed out (recorded): nothing moves
    if (a.src_idx_copy != nullptr && threadIdx.x == 0) take_src_idx_ticket(self, layout, int(gridDim.x));
    return;
  }
  dispatch_payload<false, kUnroll, kPrefetch>(a, layout, peers, ctx, int(gridDim.x));
}

// DEEPCOMM_DISPATCH_COPY=bulk moves x rows with bulk copies (x 16-byte aligned; x_row_bytes is a multiple of 16,
// asserted below). Not the default: on one H200 at world size 1 it took 117.8 us against 75.7 us for the vector
// stores (4096 tokens, hidden 7168, 24 SMs; 321.8 against 189.5 at 8 SMs); over NVLink it has not been measured.
bool dispatch_uses_bulk_copies(const DispatchArgs& args) {
  static const bool chosen = [] {
    const char* env = std::getenv("DEEPCOMM_DISPATCH_COPY");
    return env != nullptr && std::strcmp(env, "bulk") == 0;
  }();
  return chosen && reinterpret_cast<uintptr_t>(args.x) % 16 == 0;
}

template <int kUnroll, bool kPrefetch>
void launch_dispatch_as(const DispatchArgs& args, int num_blocks, const NvlLayout& layout, const Peers& peers,
                        const WaitCtx& ctx, cudaStream_t stream) {
  launch_kernel(dispatch_kernel<false, kUnroll, kPrefetch>, num_blocks, kDispatchThreads, 0, stream, args.after_notify,
                args, layout, peers, ctx);
}

template <int kUnroll, bool kPrefetch>
void launch_fused_as(const NotifyArgs& na, const DispatchArgs& args, int num_blocks, const NvlLayout& layout,
                     const Peers& peers, const WaitCtx& ctx, cudaStream_t stream) {
  constexpr auto kernel = dispatch_fused_kernel<kUnroll, kPrefetch>;
  const int smem = notify_detail::notify_smem_bytes(na.num_experts);
  opt_in_dynamic_smem<kernel>(smem);
  kernel<<<num_blocks, kDispatchThreads, smem, stream>>>(na, args, layout, peers, ctx);
  DC_CUDA_CHECK(cudaGetLastError());
}

// The vector-store variant (tuning.hpp): DEEPCOMM_DISPATCH_UNROLL 16 (the default) or 8 vectors per lane in
// flight, DEEPCOMM_DISPATCH_PREFETCH 1 (the default) loads the next token's metadata early. At world size 1,
// 4096 tokens, 24 SMs, unroll 16 with prefetch took 64.0 / 40.0 us (BF16 / FP8) where unroll 8 without took 76.4 /
// 53.5 (dev/profile_sweep.py).
void launch_dispatch(const DispatchArgs& args, int num_blocks, const NvlLayout& layout, const Peers& peers,
                     const WaitCtx& ctx, cudaStream_t stream) {
  DC_HOST_ASSERT(num_blocks >= 1 && num_blocks <= kMaxBlocks, "dispatch: num_sms out of range");
  DC_HOST_ASSERT(layout.num_ranks <= kMaxRanks, "dispatch: too many ranks for the NVLink transport");
  DC_HOST_ASSERT(args.x_row_bytes % 16 == 0 && args.scale_row_bytes % 4 == 0, "dispatch: row bytes misaligned");
  DC_HOST_ASSERT(args.topk <= 32, "dispatch: topk must be <= 32");
  if (dispatch_uses_bulk_copies(args)) {
    const int smem = kDispatchThreads / 32 * BulkChunking(args.x_row_bytes).warp_smem();
    opt_in_dynamic_smem<dispatch_kernel<true>>(smem);
    launch_kernel(dispatch_kernel<true>, num_blocks, kDispatchThreads, smem, stream, args.after_notify, args, layout,
                  peers, ctx);
  } else {
    const int unroll = tuning(kTuneDispatchUnroll);
    const bool prefetch = tuning(kTuneDispatchPrefetch) != 0;
    DC_HOST_ASSERT(unroll == 8 || unroll == 16, "dispatch: DEEPCOMM_DISPATCH_UNROLL must be 8 or 16");
    if (unroll == 16)
      prefetch ? launch_dispatch_as<16, true>(args, num_blocks, layout, peers, ctx, stream)
               : launch_dispatch_as<16, false>(args, num_blocks, layout, peers, ctx, stream);
    else
      prefetch ? launch_dispatch_as<8, true>(args, num_blocks, layout, peers, ctx, stream)
               : launch_dispatch_as<8, false>(args, num_blocks, layout, peers, ctx, stream);
  }
  DC_CUDA_CHECK(cudaGetLastError());
}

bool launch_dispatch_fused(const NotifyArgs& na, const DispatchArgs& args, int num_blocks, const NvlLayout& layout,
                           const Peers& peers, const WaitCtx& ctx, cudaStream_t stream) {
  if (tuning(kTuneDispatchFused) == 0 || dispatch_uses_bulk_copies(args) || notify_blocks(na.num_tokens) > num_blocks)
    return false;
  notify_detail::check_notify_args(na, layout);
  DC_HOST_ASSERT(num_blocks >= 1 && num_blocks <= kMaxBlocks, "dispatch: num_sms out of range");
  DC_HOST_ASSERT(args.x_row_bytes % 16 == 0 && args.scale_row_bytes % 4 == 0, "dispatch: row bytes misaligned");
  DC_HOST_ASSERT(args.topk <= 32 && args.invalid_count != nullptr, "dispatch: topk must be <= 32, with a count");
  const int unroll = tuning(kTuneDispatchUnroll);
  const bool prefetch = tuning(kTuneDispatchPrefetch) != 0;
  DC_HOST_ASSERT(unroll == 8 || unroll == 16, "dispatch: DEEPCOMM_DISPATCH_UNROLL must be 8 or 16");
  if (unroll == 16)
    prefetch ? launch_fused_as<16, true>(na, args, num_blocks, layout, peers, ctx, stream)
             : launch_fused_as<16, false>(na, args, num_blocks, layout, peers, ctx, stream);
  else
    prefetch ? launch_fused_as<8, true>(na, args, num_blocks, layout, peers, ctx, stream)
             : launch_fused_as<8, false>(na, args, num_blocks, layout, peers, ctx, stream);
  return true;
}

}  // namespace dc
