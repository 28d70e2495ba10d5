// The notify phase of a fresh dispatch, as a device function: the body of notify.cu's kernel, and the first part of
// the fused dispatch kernel (dispatch.cu), which runs it in its own first blocks. What it does is described in
// notify.cu.
#pragma once
#include "../runtime/cuda_check.hpp"
#include "../runtime/wait.cuh"
#include "agree.cuh"
#include "api.hpp"
#include "notify_trace_points.hpp"

namespace dc {
namespace notify_detail {


constexpr int kNotifyThreads = kNotifyChunk;
constexpr int kNotifyWarps = kNotifyThreads / 32;
constexpr int kNotifyMaxBlocks = 256;  // 128k tokens per rank
static_assert(kNotifyMaxBlocks == kNotifyTraceBlocks, "a notify trace has a row per block");

// How a block's notify phase ended: not the last block (its part is done), or the last block (the whole phase):
// the counts are out, or the call stopped (a difference of the ranks' words, or a wait that gave up).
enum NotifyEnd : int { kNotifyNotLast = 0, kNotifyCountsOut = 1, kNotifyStopped = 2 };

// The launch-time checks of a notify phase's arguments (notify.cu's launcher and the fused dispatch's).
inline void check_notify_args(const NotifyArgs& args, const NvlLayout& layout) {
  DC_HOST_ASSERT(layout.num_ranks <= kMaxRanks, "notify: too many ranks for the NVLink transport");
  DC_HOST_ASSERT(args.num_experts % layout.num_ranks == 0 &&
                     args.num_experts / layout.num_ranks <= layout.num_local_experts,
                 "notify: num_experts is over the buffer's capacity");
  DC_HOST_ASSERT(args.num_tokens <= layout.max_tokens, "notify: tokens over the buffer's maximum");
  DC_HOST_ASSERT(args.topk >= 0 && args.topk <= 32, "notify: topk must be <= 32");
  DC_HOST_ASSERT(args.num_experts / layout.num_ranks <= kCountsMaxExperts, "notify: too many local experts");
  DC_HOST_ASSERT(notify_blocks(args.num_tokens) <= kNotifyMaxBlocks, "notify: too many tokens");
}

// Dynamic shared memory the phase needs: a count per expert.
__host__ __device__ inline int notify_smem_bytes(int num_experts) { return num_experts * int(sizeof(int)); }

struct NotifyShared {
  int warp_count[kNotifyWarps][kMaxRanks];  // tokens of each warp to each rank, then its exclusive prefix
  int rank_total[kMaxRanks];                // block's tokens to each rank; in the last block, the rank's total
  int chunk_base[kMaxRanks];                // tokens of the chunks before ours to each rank
  int invalid;
  int last;
  int chunk;                                // which kNotifyChunk tokens this block counts
  uint64_t seq;                             // the call's number (the last block), or
  uint64_t tag;                             // ... its number as every block reads it: the chunks' tag
  // followed in dynamic shared memory by int expert_count[num_experts]
};

// A chunk's count of tokens to a rank as it is published: the low 32 bits of the call's number above the count.
__device__ __forceinline__ uint64_t chunk_word(uint64_t tag, int count) {
  return (uint64_t(uint32_t(tag)) << 32) | uint32_t(count);
}

// One thread's token: which ranks it goes to, and its experts counted once each in expert_count.
__device__ __forceinline__ uint32_t token_ranks(const int64_t* row, int topk, int num_experts, int experts_per_rank,
                                                int* expert_count, int* invalid) {
  int64_t ids[32];
#pragma unroll
  for (int k = 0; k < 32; ++k) ids[k] = k < topk ? __ldg(row + k) : -1;
  uint32_t mask = 0;
#pragma unroll
  for (int k = 0; k < 32; ++k) {
    if (k >= topk) break;
    const int64_t e = ids[k];
    if (e < -1 || e >= num_experts) {  // counted and skipped; the host turns it into a ValueError
      atomicAdd(invalid, 1);
      continue;
    }
    if (e < 0) continue;
    mask |= 1u << (e / experts_per_rank);
    bool first = true;
#pragma unroll
    for (int j = 0; j < 32; ++j)
      if (j < k) first &= ids[j] != e;
    if (first) atomicAdd(&expert_count[e], 1);
  }
  return mask;
}

// Diagnostics (notify_trace_points.hpp): thread 0 stamps `point` for its block. trace_after_sync first waits for
// the whole block (trace is the same for every thread, so the barrier is uniform); without a trace, one branch.
__device__ __forceinline__ void trace_stamp(uint64_t* trace, int point) {
  if (trace != nullptr && threadIdx.x == 0) {
    uint64_t* at = trace + (int64_t(blockIdx.x) * kNotifyTracePoints + point) * 2;
    at[0] = ptx::globaltimer_ns();
    at[1] = uint64_t(clock64());
  }
}
__device__ __forceinline__ void trace_after_sync(uint64_t* trace, int point) {
  if (trace == nullptr) return;
  __syncthreads();
  trace_stamp(trace, point);
}

// The notify phase of blocks 0..G-1 (one token per thread; notify.cu's kernel, or the first part of a fused
// dispatch in dispatch.cu). Each block reads the call's number (counter + 1) at entry, into `seq` for every thread.
// Not `fused`: a kernel of its own, which advances the counter itself and lets the payload kernel behind it in;
// `fused`: the fused kernel advances it by entry tickets (call_entry.cuh), which these blocks take after this
// phase, so that the phase does not wait for a ticket's round trip first. `counts_done` (the fused dispatch's,
// else null): released with the call's number as soon as the counts the payload reads are written, before the
// counts for the host, so that the payload does not wait for those stores.
__device__ __forceinline__ NotifyEnd notify_phase(const NotifyArgs& a, const NvlLayout& layout, const Peers& peers,
                                                  const WaitCtx& ctx_base, int G, bool fused, uint64_t& seq,
                                                  uint64_t* counts_done = nullptr) {
  __shared__ NotifyShared sh;
  extern __shared__ int dyn[];
  int* expert_count = dyn;
  const int R = layout.num_ranks, E = a.num_experts, L = E / R, rank = ctx_base.rank;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // One block (up to kNotifyChunk tokens): its counts are the totals, with no accumulation in NotifyWork, no
  // ticket and no second read of the counts: four dependent memory round trips fewer.
  const bool single = G == 1;
  uint8_t* self = peers.base[rank];
  uint8_t* work = self + layout.notify_work;
  const NotifyWork wl(R, layout.num_local_experts, layout.max_tokens);
  int* expert_acc = reinterpret_cast<int*>(work + wl.expert_acc);
  uint64_t* chunk_count = reinterpret_cast<uint64_t*>(work + wl.chunk_count);
  uint64_t* counter = reinterpret_cast<uint64_t*>(self + layout.seq_counter);
  trace_stamp(a.trace, kNotifyTraceEntry);
  // The payload kernel behind us (launched with programmatic dependent launch) may now put its blocks on the SMs:
  // they wait for this kernel to complete before they read anything (dispatch.cu), and every block of ours is
  // resident by the time the last one gets here, so none of ours is kept out.
  if (!fused) ptx::launch_dependents();

  for (int i = tid; i < E; i += blockDim.x) expert_count[i] = 0;
  if (tid == 0) {
    sh.invalid = 0;
    // Chunks go to the blocks in the order they get here, so that the chunks a block waits for below are held by
    // blocks already running. The counter is read before any ticket is taken, so every block reads the number
    // before the last block advances it.
    sh.chunk = single ? 0 : int(atomicAdd(reinterpret_cast<unsigned*>(work + NotifyWork::kChunkTicket), 1u));
    sh.tag = *counter + 1;
  }
  __syncthreads();
  seq = sh.tag;

  // ---- this block's tokens ----
  const int chunk = sh.chunk;
  const int t = chunk * kNotifyChunk + tid;
  const uint32_t mask = t < a.num_tokens ? token_ranks(a.topk_idx + int64_t(t) * a.topk, a.topk, E, L, expert_count,
                                                       &sh.invalid)
                                         : 0u;
  uint32_t ballots[kMaxRanks];
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) {
    ballots[r] = __ballot_sync(0xffffffffu, (mask >> r) & 1u);
    if (lane == 0 && r < R) sh.warp_count[warp][r] = __popc(ballots[r]);
  }
  __syncthreads();
  trace_stamp(a.trace, kNotifyTraceCounted);
  if (tid < R) {
    int running = 0;
    for (int w = 0; w < kNotifyWarps; ++w) {
      const int c = sh.warp_count[w][tid];
      sh.warp_count[w][tid] = running;
      running += c;
    }
    sh.rank_total[tid] = running;
    sh.chunk_base[tid] = 0;
    // our counts out for the chunks after ours, each with the call's tag in the same word
    if (!single) ptx::st_relaxed_gpu_u64(chunk_count + chunk * R + tid, chunk_word(sh.tag, running));
  }
  __syncthreads();
  if (!single) {
    // The counts of the chunks before ours, one word each, waited for (bounded) until it carries this call's tag:
    // every block publishes before it waits, so these waits end about when the last block has counted.
    for (int i = tid; i < chunk * R; i += blockDim.x) {
      uint64_t v = 0;
      wait_until([&] {
        v = ptx::ld_relaxed_gpu_u64(chunk_count + i);
        return uint32_t(v >> 32) == uint32_t(sh.tag);
      }, ctx_base, rank, kStageNotifyLocal);
      atomicAdd(&sh.chunk_base[i % R], int(uint32_t(v)));
    }
    __syncthreads();
  }
  if (t < a.num_tokens) {
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      if (r >= R) break;
      const bool in = (mask >> r) & 1u;
      a.is_token_in_rank[int64_t(t) * R + r] = in;
      a.send_pos[int64_t(t) * R + r] =
          in ? sh.chunk_base[r] + sh.warp_count[warp][r] + __popc(ballots[r] & ptx::lanemask_lt()) : -1;
    }
  }
  if (!single) {
    for (int e = tid; e < E; e += blockDim.x)
      if (expert_count[e] != 0) atomicAdd(expert_acc + e, expert_count[e]);
    if (tid == 0 && sh.invalid != 0) atomicAdd(reinterpret_cast<int*>(work + wl.invalid), sh.invalid);
    __threadfence();  // every thread's stores above are visible GPU-wide before thread 0 takes the ticket
    __syncthreads();
    if (tid == 0) {
      ptx::fence_acq_rel_gpu();  // our send_pos, block counts and sums before the ticket
      const uint32_t ticket = ptx::atom_add_release_gpu_u32(reinterpret_cast<uint32_t*>(work + wl.ticket), 1u);
      sh.last = ticket == uint32_t(G - 1);
      if (sh.last) ptx::fence_acq_rel_gpu();
    }
    __syncthreads();
  }
  trace_stamp(a.trace, kNotifyTraceTicket);
  if (!single && !sh.last) return kNotifyNotLast;

  // ---- the last block: totals, the sequence number (a single block's own counts, rank totals and invalid count
  // are the totals already) ----
  if (!single && tid < R) {
    int running = 0;
    for (int c = 0; c < G; ++c) running += int(uint32_t(ptx::ld_relaxed_gpu_u64(chunk_count + c * R + tid)));
    sh.rank_total[tid] = running;
  }
  if (tid == 0) {
    if (!single) {
      sh.invalid = __ldcg(reinterpret_cast<int*>(work + wl.invalid));
      *reinterpret_cast<int*>(work + wl.invalid) = 0;
      *reinterpret_cast<uint32_t*>(work + wl.ticket) = 0u;
      *reinterpret_cast<uint32_t*>(work + NotifyWork::kChunkTicket) = 0u;
    }
    sh.seq = sh.tag;  // the call's number
    if (!fused) *counter = sh.seq;  // advanced here instead of by a bump kernel
  }
  if (!single) {
    for (int e = tid; e < E; e += blockDim.x) {
      expert_count[e] = __ldcg(expert_acc + e);
      expert_acc[e] = 0;
    }
  }
  __syncthreads();
  trace_after_sync(a.trace, kNotifyTracePrefixes);
  WaitCtx ctx = ctx_base;
  ctx.seq = sh.seq;

  // Our row of the count matrix, each peer's expert counts and our count of invalid expert ids go to row
  // `rank` of its notify_counts, so every rank learns when any rank's input was bad and all of them stop.
  const int row_len = R + L + 1;
  const NotifyOut out(R, L);  // where the results go in a.notify_out (nvl_layout.hpp)
  const bool agree = agree_on(a.agree);
  // The call's words go to every peer (its slot for us) with the counts; one system-scope fence then releases
  // both the words' tag and the counts' flag.
  uint64_t* agree_tag = nullptr;
  if (agree && tid < R)
    agree_tag = agree_store_words(peers.base[tid] + layout.agree_at(ctx.seq) + int64_t(rank) * kAgreeSlotBytes,
                                  a.agree);
  for (int i = tid; i < R * row_len; i += blockDim.x) {
    const int dst = i / row_len, j = i % row_len;
    const int v = j < R ? sh.rank_total[j] : (j < R + L ? expert_count[dst * L + (j - R)] : sh.invalid);
    reinterpret_cast<int*>(peers.base[dst] + layout.notify_counts_at(ctx.seq))[rank * row_len + j] = v;
  }
  __syncthreads();
  if (tid < R)
    release_words_and_flag(agree_tag, reinterpret_cast<uint64_t*>(peers.base[tid] + layout.notify_flag) + rank,
                           ctx.seq);
  trace_after_sync(a.trace, kNotifyTraceSent);
  DispatchCounts* host = a.host_counts;
  // Every rank's words before the counts are used: a rank that rejected its call, or one in another call, sends
  // only its words (agree_reject.cu), so they are waited for first. On a difference nothing is dispatched on any
  // rank: the payload sees a non-zero invalid count, and the host learns why (the counts, or the AgreeRecord).
  if (agree) {
    const uint8_t* slots = self + layout.agree_at(ctx.seq);
    const AgreeResult ar = agree_block(slots, a.agree, ctx.seq, R, AllRanks{}, ctx, kStageAgree, host == nullptr,
                                       host != nullptr ? host->agree_rows : nullptr);
    if (ar.status < 0) return kNotifyStopped;
    if (ar.status == 0) {
      if (tid == 0) {
        a.notify_out[out.bad_all] = -1;
        a.notify_out[out.bad_mine] = 0;
        if (host != nullptr) {  // every rank's words (agree_rows, by agree_block) before the words that say so
          const uint32_t tag = count_tag(a.host_tag);
          ptx::fence_acq_rel_sys();
          ptx::st_relaxed_sys_u64(&host->disagree_word, tagged_count(tag, ar.word));
          ptx::st_relaxed_sys_u64(&host->disagree, tagged_count(tag, ar.peer + 1));
        }
      }
      return kNotifyStopped;
    }
  }
  trace_stamp(a.trace, kNotifyTraceAgreed);  // agree_block returns after a barrier of the block, or at once
  __shared__ int ok;
  if (tid == 0) ok = 1;
  __syncthreads();
  if (tid < R) {
    const auto* flag = reinterpret_cast<const uint64_t*>(self + layout.notify_flag) + tid;
    if (!wait_flag_geq(flag, ctx.seq, ctx, tid, kStageNotifyCounts)) ok = 0;
  }
  __syncthreads();
  if (!ok) return kNotifyStopped;  // the host sees the error record instead of the tag
  trace_stamp(a.trace, kNotifyTraceFlags);
  const int* counts = reinterpret_cast<const int*>(self + layout.notify_counts_at(ctx.seq));
  const uint32_t host_tag = count_tag(a.host_tag);
  for (int i = tid; i < R * R; i += blockDim.x)
    a.notify_out[out.count_matrix + i] = ptx::ld_volatile_s32(counts + (i / R) * row_len + i % R);
  for (int l = tid; l < L; l += blockDim.x) {
    int sum = 0;
    for (int s = 0; s < R; ++s) sum += ptx::ld_volatile_s32(counts + s * row_len + R + l);
    a.notify_out[out.per_expert + l] = sum;
    if (host != nullptr) ptx::st_relaxed_sys_u64(&host->per_expert[l], tagged_count(host_tag, sum));
  }
  __shared__ int recv_total;
  if (tid == 0) {
    int bad = 0, recv = 0;
    for (int s = 0; s < R; ++s) {
      bad += ptx::ld_volatile_s32(counts + s * row_len + R + L);
      recv += ptx::ld_volatile_s32(counts + s * row_len + rank);
    }
    a.notify_out[out.bad_all] = bad;
    a.notify_out[out.bad_mine] = sh.invalid;
    recv_total = recv;
  }
  if (counts_done != nullptr) {
    __syncthreads();  // every thread's device counts before the release
    if (tid == 0) {
      ptx::fence_acq_rel_gpu();
      ptx::st_release_gpu_u64(counts_done, ctx.seq);
    }
  }
  if (tid == 0 && host != nullptr) {  // tagged words: the host takes each as it comes, `disagree` first
    ptx::st_relaxed_sys_u64(&host->num_recv, tagged_count(host_tag, recv_total));
    ptx::st_relaxed_sys_u64(&host->bad_all, tagged_count(host_tag, a.notify_out[out.bad_all]));
    ptx::st_relaxed_sys_u64(&host->bad_mine, tagged_count(host_tag, sh.invalid));
    ptx::st_relaxed_sys_u64(&host->num_local_experts, tagged_count(host_tag, L));
    ptx::st_relaxed_sys_u64(&host->disagree, tagged_count(host_tag, 0));
  }
  trace_after_sync(a.trace, kNotifyTraceHost);
  return kNotifyCountsOut;
}

}  // namespace notify_detail
}  // namespace dc
