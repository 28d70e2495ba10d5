// Per-block completion flags: region [R][kMaxBlocks] u64 in every rank's buffer; block b of rank s raises
// [s][b] at each rank after all its stores there (normal dispatch; its receivers wait for the flags they need).
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

}  // namespace dc
