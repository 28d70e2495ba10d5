// One thread block computes the whole dispatch layout of a routing: per-rank and per-expert token counts,
// is_token_in_rank and the send position of every (token, rank). Shared by the layout and notify kernels.
#pragma once
#include <cstdint>

#include "../../ptx/ptx.cuh"

namespace dc {

constexpr int kLayoutThreads = 1024;
constexpr int kLayoutWarps = kLayoutThreads / 32;
constexpr int kLayoutMaxRanks = 64;

struct LayoutShared {
  int warp_prefix[kLayoutWarps][kLayoutMaxRanks];  // exclusive prefix of each warp inside the current chunk
  int rank_total[kLayoutMaxRanks];                 // tokens to each rank so far
  int invalid;                                     // slots whose expert id is outside [-1, E)
  // followed in dynamic shared memory by int expert_count[num_experts]
};

__device__ inline void compute_layout_block(const int64_t* topk_idx, int num_tokens, int topk, int num_experts,
                                            int num_ranks, LayoutShared& sh, int* expert_count,
                                            bool* is_token_in_rank, int* send_pos) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int experts_per_rank = num_experts / num_ranks;
  for (int i = tid; i < num_experts; i += blockDim.x) expert_count[i] = 0;
  for (int i = tid; i < num_ranks; i += blockDim.x) sh.rank_total[i] = 0;
  if (tid == 0) sh.invalid = 0;
  __syncthreads();

  for (int chunk = 0; chunk < num_tokens; chunk += kLayoutThreads) {
    const int t = chunk + tid;
    uint64_t mask = 0;
    if (t < num_tokens) {
      const int64_t* row = topk_idx + int64_t(t) * topk;
      for (int k = 0; k < topk; ++k) {
        const int64_t e = row[k];
        if (e < -1 || e >= num_experts) {  // counted and skipped; the host turns it into a ValueError
          atomicAdd(&sh.invalid, 1);
          continue;
        }
        if (e < 0) continue;
        mask |= 1ull << (e / experts_per_rank);
        bool first = true;
        for (int j = 0; j < k; ++j) first &= (row[j] != e);
        if (first) atomicAdd(&expert_count[e], 1);
      }
    }
    for (int r = 0; r < num_ranks; ++r) {
      const uint32_t ballot = __ballot_sync(0xffffffffu, (mask >> r) & 1ull);
      if (lane == 0) sh.warp_prefix[warp][r] = __popc(ballot);
    }
    __syncthreads();
    // Turn per-warp counts into exclusive prefixes; R threads, one rank each.
    if (tid < num_ranks) {
      int running = sh.rank_total[tid];
      for (int w = 0; w < kLayoutWarps; ++w) {
        const int c = sh.warp_prefix[w][tid];
        sh.warp_prefix[w][tid] = running;
        running += c;
      }
      sh.rank_total[tid] = running;
    }
    __syncthreads();
    for (int r = 0; r < num_ranks; ++r) {
      const bool in = (mask >> r) & 1ull;
      const uint32_t ballot = __ballot_sync(0xffffffffu, in);
      if (t < num_tokens) {
        is_token_in_rank[int64_t(t) * num_ranks + r] = in;
        if (send_pos != nullptr)
          send_pos[int64_t(t) * num_ranks + r] =
              in ? sh.warp_prefix[warp][r] + __popc(ballot & ptx::lanemask_lt()) : -1;
      }
    }
    __syncthreads();
  }
}

__device__ inline void write_layout_counts(const LayoutShared& sh, const int* expert_count, int num_experts,
                                           int num_ranks, int* tokens_per_rank, int* tokens_per_expert) {
  for (int i = threadIdx.x; i < num_ranks; i += blockDim.x) tokens_per_rank[i] = sh.rank_total[i];
  for (int i = threadIdx.x; i < num_experts; i += blockDim.x) tokens_per_expert[i] = expert_count[i];
}

}  // namespace dc
