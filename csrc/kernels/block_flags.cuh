// Per-block completion flags: region [R][kMaxBlocks] u64 in every rank's buffer; block b of rank s raises
// [s][b] at each rank after all its stores there, and a receiver waits for the flags it needs.
#pragma once
#include "../runtime/wait.cuh"
#include "api.hpp"

namespace dc {

// Call after __syncthreads() that ends the block's stores: threads 0..R-1 each publish to one rank.
__device__ __forceinline__ void signal_block_done(const Peers& peers, int64_t region, int num_ranks,
                                                  const WaitCtx& ctx) {
  if (threadIdx.x < num_ranks) {
    ptx::fence_acq_rel_sys();
    auto* flags = reinterpret_cast<uint64_t*>(peers.base[threadIdx.x] + region);
    ptx::st_release_sys_u64(flags + ctx.rank * kMaxBlocks + blockIdx.x, ctx.seq);
  }
}

// The whole block waits for blocks [0, num_blocks) of every rank; false (for every thread) when a wait timed out.
__device__ __forceinline__ bool wait_all_blocks_done(const uint8_t* self, int64_t region, int num_ranks,
                                                     int num_blocks, const WaitCtx& ctx, int stage, int* ok) {
  if (threadIdx.x == 0) *ok = 1;
  __syncthreads();
  const auto* flags = reinterpret_cast<const uint64_t*>(self + region);
  for (int i = threadIdx.x; i < num_ranks * num_blocks; i += blockDim.x) {
    const int s = i / num_blocks, b = i % num_blocks;
    if (!wait_flag_geq(flags + s * kMaxBlocks + b, ctx.seq, ctx, s, stage)) *ok = 0;
  }
  __syncthreads();
  return *ok != 0;
}

}  // namespace dc
