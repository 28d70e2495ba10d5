// Pieces the four low-latency kernels share: the per-call sequence number, the ordered rank of each entry among
// its expert's entries, the packed-row bases of the local experts, and warp-wide "which ranks does this token go to".
#pragma once
#include <cstdint>

#include "../../ptx/ptx.cuh"
#include "../runtime/ll_layout.hpp"
#include "../runtime/wait.cuh"

namespace dc {

constexpr int kLlThreads = 256;
constexpr int kLlWarps = kLlThreads / 32;

// Bit r set when rank r is not masked (csrc/runtime/ll_layout.hpp "mask"); we are always alive.
__device__ __forceinline__ uint32_t ll_alive_ranks(const uint8_t* self, const LlLayout& l, int rank) {
  const int* mask = reinterpret_cast<const int*>(self + l.mask);
  uint32_t alive = 1u << rank;
  for (int r = 0; r < l.num_ranks; ++r)
    if (ptx::ld_volatile_s32(mask + r) == 0) alive |= 1u << r;
  return alive;
}

__device__ __forceinline__ bool ll_is_alive(uint32_t alive, int r) { return (alive >> r) & 1u; }

// A send's call number: one more than the last one of its kind. Every block reads the counter at entry; the last
// block to finish its send (ll_finish_send) stores the new value, so no block can read it early. No separate
// launch is needed, and CUDA-graph replays advance it too.
__device__ __forceinline__ uint64_t ll_send_seq(const uint8_t* self, const LlLayout& l, LlKind kind) {
  return reinterpret_cast<const uint64_t*>(self + l.seq)[kind] + 1;
}

// The call number a receive kernel waits for: the one its slot's send used (sends of the other slot, or of the
// other kind, may have run in between).
__device__ __forceinline__ uint64_t ll_recv_seq(const uint8_t* self, const LlLayout& l, LlKind kind, int slot) {
  return ptx::ld_relaxed_sys_u64(reinterpret_cast<const uint64_t*>(self + l.slot_seq) + kind * 2 + slot);
}

// Diagnostics (DEEPCOMM_LL_TRACE=1, launch/profile_low_latency.py): thread 0 of every block stamps the global
// timer at numbered points of a call into trace[block][point] (kLlTrace* below); nothing when trace is null.
constexpr int kLlTracePoints = 8;
enum LlTracePoint : int {
  kLlTraceEntry = 0,      // kernel entry
  kLlTraceSendData = 1,   // send: this block's rows stored
  kLlTraceSendMeta = 2,   // send: keys / counts stored, before the finish
  kLlTraceFinished = 3,   // send: fenced and counted done (the last block also signalled the ranks)
  kLlTraceWeights = 4,    // combine send: our weights published, expert row bases known
  kLlTraceArrived = 5,    // receive: every rank's arrival word reached
  kLlTraceRecvMeta = 6,   // dispatch receive: expert bases and token counts known
  kLlTraceEnd = 7,        // receive: this block's rows written
};
__device__ __forceinline__ void ll_trace(uint64_t* trace, int point) {
  if (trace != nullptr && threadIdx.x == 0) trace[blockIdx.x * kLlTracePoints + point] = ptx::globaltimer_ns();
}

// Which halves a launch runs: the send half, the receive half (hook mode launches them apart, so no SM is held
// in between), or both in one kernel (no hook: one launch per call, and a block goes on to receive as soon as the
// data it waits for has landed).
enum LlPhases : int { kLlSendPhase = 1, kLlRecvPhase = 2, kLlBothPhases = 3 };

// Sends of this kind already made in `slot` (advanced by the last block of each send, ll_finish_send).
__device__ __forceinline__ uint64_t ll_slot_calls(const uint8_t* self, const LlLayout& l, LlKind kind, int slot) {
  return ptx::ld_relaxed_sys_u64(reinterpret_cast<const uint64_t*>(self + l.slot_calls) + kind * 2 + slot);
}

// What every launch reads at entry, before its own send half can finish (that send's last block advances the
// call numbers): the call's sequence number (into ctx.seq: a send's new number, or the one the slot's send used),
// the slot's send count every rank must reach before the receive half runs (returned), and the live ranks.
template <bool kSend>
__device__ __forceinline__ uint64_t ll_enter(const uint8_t* self, const LlLayout& l, LlKind kind, int slot,
                                             WaitCtx& ctx, uint32_t* alive) {
  ctx.seq = kSend ? ll_send_seq(self, l, kind) : ll_recv_seq(self, l, kind, slot);
  *alive = ll_alive_ranks(self, l, ctx.rank);
  return ll_slot_calls(self, l, kind, slot) + (kSend ? 1 : 0);
}

// Every block of a send calls this once, on every path, at its very end; ok = false when the block gave up (a
// timed-out wait). The last block to finish advances the call numbers and, unless some block gave up, tells every
// rank that this call's stores into it are complete: one store of the slot's new call count into that rank's
// arrival word for us. Each block fences at system scope before it counts itself done, and the last block fences
// again after seeing the count, so its flag stores are ordered after every block's data (release fence, atomic,
// atomic, acquire fence; then relaxed stores after that fence): a single signal per call and rank instead of one
// release atomic per block on one remote word.
__device__ __forceinline__ void ll_finish_send(uint8_t* self, const Peers& peers, const LlLayout& l, LlKind kind,
                                               int slot, uint64_t seq, int rank, uint32_t alive, bool ok,
                                               uint64_t* trace) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  auto* words = reinterpret_cast<unsigned int*>(self + l.done_count) + kind * 2;  // [blocks done, blocks failed]
  if (!ok) atomicAdd(words + 1, 1u);
  ptx::fence_acq_rel_sys();
  if (atomicAdd(words, 1u) != gridDim.x - 1) {
    ll_trace(trace, kLlTraceFinished);
    return;
  }
  ptx::fence_acq_rel_sys();
  const bool failed = atomicExch(words + 1, 0u) != 0u;
  words[0] = 0u;
  auto* calls_word = reinterpret_cast<uint64_t*>(self + l.slot_calls) + kind * 2 + slot;
  const uint64_t calls = *calls_word + 1;
  reinterpret_cast<uint64_t*>(self + l.seq)[kind] = seq;
  reinterpret_cast<uint64_t*>(self + l.slot_seq)[kind * 2 + slot] = seq;
  *calls_word = calls;
  if (!failed) {
    for (int r = 0; r < l.num_ranks; ++r)
      if (ll_is_alive(alive, r))
        ptx::st_relaxed_sys_u64(reinterpret_cast<uint64_t*>(peers.base[r] + l.arrivals_at(kind, slot)) + rank, calls);
  }
  __threadfence();
  ll_trace(trace, kLlTraceFinished);
}

// The whole block waits until every live rank has completed its send number `calls` of this kind into `slot`.
// False for every thread after a timeout.
__device__ __forceinline__ bool ll_wait_arrivals(const uint8_t* self, const LlLayout& l, LlKind kind, int slot,
                                                 uint64_t calls, uint32_t alive, const WaitCtx& ctx, int stage,
                                                 int* ok) {
  if (threadIdx.x == 0) *ok = 1;
  __syncthreads();
  if (threadIdx.x < l.num_ranks && ll_is_alive(alive, threadIdx.x)) {
    const auto* word = reinterpret_cast<const uint64_t*>(self + l.arrivals_at(kind, slot)) + threadIdx.x;
    if (!wait_flag_geq(word, calls, ctx, threadIdx.x, stage)) *ok = 0;
  }
  __syncthreads();
  return *ok != 0;
}

// The whole block gives each valid entry p in [0, n) (expert >= 0) its rank among the earlier entries of the same
// expert, and counts[e] the entries of e. Warp w ranks a contiguous share of the entries, counting into its own
// row wcount[w][E] (comparing each lane's expert with all 32 of the chunk by shuffles: a fixed cost, unlike
// match_any with many distinct values); then the rows become per-expert prefixes over the warps and each entry
// adds its warp's prefix. wcount: kLlWarps * E ints of shared memory. Ends with __syncthreads.
__device__ __forceinline__ void ll_rank_entries(const int* experts, int n, int num_experts, int* rank_in, int* counts,
                                                int* wcount) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < kLlWarps * num_experts; i += blockDim.x) wcount[i] = 0;
  __syncthreads();
  const int span = ((n + kLlWarps - 1) / kLlWarps + 31) / 32 * 32;
  int* mine = wcount + warp * num_experts;
  const int end = min(n, (warp + 1) * span);
  for (int base = warp * span; base < end; base += 32) {
    const int p = base + lane;
    const int e = p < end ? experts[p] : -1;
    int before = 0, same = 0;
#pragma unroll 8
    for (int j = 0; j < 32; ++j) {
      const int o = __shfl_sync(0xffffffffu, e, j);
      same += o == e;
      before += (o == e) & (j < lane);
    }
    const int prior = e >= 0 ? mine[e] : 0;
    __syncwarp();
    if (e >= 0) {
      rank_in[p] = prior + before;
      if (before == 0) mine[e] = prior + same;
    }
    __syncwarp();
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int run = 0;
    for (int w = 0; w < kLlWarps; ++w) {
      const int c = wcount[w * num_experts + e];
      wcount[w * num_experts + e] = run;
      run += c;
    }
    counts[e] = run;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < n; p += blockDim.x)
    if (experts[p] >= 0) rank_in[p] += wcount[(p / span) * num_experts + experts[p]];
  __syncthreads();
}

// Entries rank s sends to expert e, as it wrote them; 0 for masked ranks (their area may hold anything).
__device__ __forceinline__ int ll_count(const int* counts, const LlLayout& l, uint32_t alive, int s, int e) {
  return ll_is_alive(alive, s) ? ptx::ld_volatile_s32(counts + s * l.num_experts + e) : 0;
}

// Packed rows of our local experts: rows of local expert le coming from rank s start at base[le * R + s];
// total[le] rows in all. counts: [R][E] as the senders wrote them. Whole block; ends with __syncthreads.
__device__ __forceinline__ void ll_expert_bases(const int* counts, const LlLayout& l, int rank, uint32_t alive,
                                                int* base, int* total) {
  const int R = l.num_ranks, L = l.local_experts();
  for (int i = threadIdx.x; i < L * R; i += blockDim.x)  // all loads in flight at once, then the prefixes
    base[i] = ll_count(counts, l, alive, i % R, rank * L + i / R);
  __syncthreads();
  for (int le = threadIdx.x; le < L; le += blockDim.x) {
    int acc = 0;
    for (int s = 0; s < R; ++s) {
      const int c = base[le * R + s];
      base[le * R + s] = acc;
      acc += c;
    }
    total[le] = acc;
  }
  __syncthreads();
}

// The flat item space of the receive halves (and the combine's send): `per_token` items for each token of each live source rank, sources
// ascending. n: [R] tokens per source (0 for masked ranks), read once per block.
__device__ __forceinline__ void ll_item_source(const int* n, int R, int per_token, int item, int* s, int* rest) {
  int k = 0;
  while (k < R - 1 && item >= n[k] * per_token) item -= n[k++] * per_token;
  *s = k;
  *rest = item;
}

// Bit d set when any of the token's slots names an expert of rank d. Lane k < K holds slot k's expert (-1 for
// none; callers have already dropped experts of masked ranks).
__device__ __forceinline__ uint32_t ll_rank_mask(int expert, int experts_per_rank) {
  return __reduce_or_sync(0xffffffffu, expert >= 0 ? 1u << (expert / experts_per_rank) : 0u);
}

}  // namespace dc
