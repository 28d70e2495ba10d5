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

// A send kernel's call number: one more than the last one of its kind. Every block reads the counter at entry;
// the last block to finish (ll_finish_send) stores the new value, so no block can read it early. No separate
// launch is needed, and CUDA-graph replays advance it too.
__device__ __forceinline__ uint64_t ll_send_seq(const uint8_t* self, const LlLayout& l, LlKind kind) {
  return reinterpret_cast<const uint64_t*>(self + l.seq)[kind] + 1;
}

// The call number a receive kernel waits for: the one its slot's send used (sends of the other slot, or of the
// other kind, may have run in between).
__device__ __forceinline__ uint64_t ll_recv_seq(const uint8_t* self, const LlLayout& l, LlKind kind, int slot) {
  return ptx::ld_relaxed_sys_u64(reinterpret_cast<const uint64_t*>(self + l.slot_seq) + kind * 2 + slot);
}

// Every block of a send kernel calls this once, on every path, at its very end.
__device__ __forceinline__ void ll_finish_send(uint8_t* self, const LlLayout& l, LlKind kind, int slot, uint64_t seq) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    auto* done = reinterpret_cast<unsigned int*>(self + l.done_count) + kind;
    if (atomicAdd(done, 1u) == gridDim.x - 1) {
      *done = 0u;
      reinterpret_cast<uint64_t*>(self + l.seq)[kind] = seq;
      reinterpret_cast<uint64_t*>(self + l.slot_seq)[kind * 2 + slot] = seq;
      reinterpret_cast<uint64_t*>(self + l.slot_calls)[kind * 2 + slot] += 1;
      __threadfence();
    }
  }
}

// A send block is done with its stores into every rank: after the __syncthreads() that ends them, threads
// 0..R-1 each add 1 to one rank's arrival counter for (kind, slot), with release ordering at system scope.
__device__ __forceinline__ void ll_signal_arrival(const Peers& peers, const LlLayout& l, LlKind kind, int slot,
                                                  int rank) {
  // The release add is cumulative: it publishes every store the barrier ordered before it, from all threads.
  if (threadIdx.x < l.num_ranks) {
    auto* counter = reinterpret_cast<uint64_t*>(peers.base[threadIdx.x] + l.arrivals_at(kind, slot)) + rank;
    ptx::atom_add_release_sys_u64(counter, 1);
  }
}

// The whole block waits until every rank's send blocks of this slot's latest call have arrived: the counter of
// rank s reaches (our sends in this slot so far) * blocks per send. False for every thread after a timeout.
__device__ __forceinline__ bool ll_wait_arrivals(const uint8_t* self, const LlLayout& l, LlKind kind, int slot,
                                                 int num_send_blocks, const WaitCtx& ctx, int stage, int* ok) {
  if (threadIdx.x == 0) *ok = 1;
  __syncthreads();
  if (threadIdx.x < l.num_ranks) {
    const uint64_t calls = ptx::ld_relaxed_sys_u64(reinterpret_cast<const uint64_t*>(self + l.slot_calls) + kind * 2 + slot);
    const auto* counter = reinterpret_cast<const uint64_t*>(self + l.arrivals_at(kind, slot)) + threadIdx.x;
    if (!wait_flag_geq(counter, calls * uint64_t(num_send_blocks), ctx, threadIdx.x, stage)) *ok = 0;
  }
  __syncthreads();
  return *ok != 0;
}

// One warp walks entries [0, n) in order and gives each valid one (expert >= 0) its rank among the earlier
// entries of the same expert; counts[e] ends as the number of entries of e. counts must start zeroed.
__device__ __forceinline__ void ll_rank_entries(const int* experts, int n, int* rank_in, int* counts, int lane) {
  for (int base = 0; base < n; base += 32) {
    const int p = base + lane;
    const int e = p < n ? experts[p] : -1;
    const uint32_t same = __match_any_sync(0xffffffffu, e);
    const int before = __popc(same & ptx::lanemask_lt());
    const int prior = e >= 0 ? counts[e] : 0;
    __syncwarp();
    if (e >= 0) {
      rank_in[p] = prior + before;
      if (before == 0) counts[e] = prior + __popc(same);
    }
    __syncwarp();
  }
}

// Packed rows of our local experts: rows of local expert le coming from rank s start at base[le * R + s];
// total[le] rows in all. counts: [R][E] as the senders wrote them. Whole block; ends with __syncthreads.
__device__ __forceinline__ void ll_expert_bases(const int* counts, const LlLayout& l, int rank, int* base,
                                                int* total) {
  const int R = l.num_ranks, E = l.num_experts, L = l.local_experts();
  for (int le = threadIdx.x; le < L; le += blockDim.x) {
    int acc = 0;
    for (int s = 0; s < R; ++s) {
      base[le * R + s] = acc;
      acc += ptx::ld_volatile_s32(counts + s * E + rank * L + le);
    }
    total[le] = acc;
  }
  __syncthreads();
}

// Bit d set when any of the token's slots names an expert of rank d. Lane k < K holds slot k's expert.
__device__ __forceinline__ uint32_t ll_rank_mask(int expert, int experts_per_rank) {
  return __reduce_or_sync(0xffffffffu, expert >= 0 ? 1u << (expert / experts_per_rank) : 0u);
}

}  // namespace dc
