// get_dispatch_layout on the GPU: no communication, no host sync.
//
// The tokens are spread over ceil(T / kLayoutThreads) blocks (capped at kLayoutMaxBlocks; a block then takes
// every G-th chunk), one token per thread. A block counts its tokens per rank and per expert in shared memory
// and adds its counts into the outputs, which the launcher zeroes first: integer atomics, so the sums are exact
// whatever order the blocks run in. is_token_in_rank is per token: each thread writes its token's row.
//
// Expert ids outside [-1, E) count nowhere and are never used as an index. A block that meets one claims the
// error record (the first claim wins, as for every input error found on the device); the claiming block alone
// counts the bad ids of the whole routing (only on this path: the common path needs no cross-block total) and
// completes the record with that count, which the host raises at its next look (deepcomm/cuda/wait_stages.py).
#include <algorithm>

#include "../runtime/cuda_check.hpp"
#include "../runtime/smem_opt_in.hpp"
#include "../runtime/wait.cuh"
#include "api.hpp"
#include "topk_max.hpp"

namespace dc {

namespace {

constexpr int kLayoutThreads = 128;    // tokens per chunk: one per thread
constexpr int kLayoutMaxBlocks = 256;  // past 32k tokens, blocks take several chunks each
constexpr int kLayoutMaxRanks = 64;    // bits of a token's rank mask

struct LayoutShared {
  int rank_count[kLayoutMaxRanks];  // the block's tokens to each rank
  int bad;                          // ids outside [-1, E): the block's, then (claiming block) the routing's
  int claimed;                      // this block claimed the error record
  // followed in dynamic shared memory by int expert_count[num_experts]
};

__device__ __forceinline__ bool bad_id(int64_t e, int num_experts) { return e < -1 || e >= num_experts; }

// One token: the ranks it goes to (bit r), each of its experts counted once in expert_count, bad ids skipped
// and counted in `bad`.
__device__ __forceinline__ uint64_t token_ranks(const int64_t* row, int topk, int num_experts, int experts_per_rank,
                                                int* expert_count, int& bad) {
  int64_t ids[kTopkMax];
#pragma unroll
  for (int k = 0; k < kTopkMax; ++k) ids[k] = k < topk ? __ldg(row + k) : -1;
  uint64_t mask = 0;
#pragma unroll
  for (int k = 0; k < kTopkMax; ++k) {
    if (k >= topk) break;
    const int64_t e = ids[k];
    if (bad_id(e, num_experts)) {
      ++bad;
      continue;
    }
    if (e < 0) continue;
    mask |= 1ull << (e / experts_per_rank);
    bool first = true;
#pragma unroll
    for (int j = 0; j < kTopkMax; ++j)
      if (j < k) first &= ids[j] != e;
    if (first) atomicAdd(&expert_count[e], 1);
  }
  return mask;
}

// A token's is_token_in_rank row: one store where R is 4 or 8 and the row is aligned (the usual case), else bytes.
__device__ __forceinline__ void write_in_rank(bool* row, uint64_t mask, int R) {
  const auto at = reinterpret_cast<uintptr_t>(row);
  if ((R == 8 || R == 4) && (at & uintptr_t(R - 1)) == 0) {
    uint64_t bytes = 0;
    for (int r = 0; r < R; ++r) bytes |= ((mask >> r) & 1ull) << (8 * r);
    if (R == 8)
      *reinterpret_cast<uint64_t*>(row) = bytes;
    else
      *reinterpret_cast<uint32_t*>(row) = uint32_t(bytes);
    return;
  }
  for (int r = 0; r < R; ++r) row[r] = (mask >> r) & 1ull;
}

// The claiming block counts every bad id of the routing and completes the record (peer: this rank; the count in
// the record's waited_ns field, which input errors otherwise leave 0).
__device__ void report_bad_ids(const LayoutArgs& a, const WaitCtx& ctx, LayoutShared& sh) {
  const int tid = threadIdx.x;
  if (tid == 0) sh.claimed = ctx.err != nullptr && claim_error_record(ctx);
  __syncthreads();
  if (!sh.claimed) return;
  int bad = 0;
  const int64_t n = int64_t(a.num_tokens) * a.topk;
  for (int64_t i = tid; i < n; i += blockDim.x) bad += bad_id(__ldg(a.topk_idx + i), a.num_experts);
  if (tid == 0) sh.bad = 0;
  __syncthreads();
  if (bad != 0) atomicAdd(&sh.bad, bad);
  __syncthreads();
  if (tid == 0) write_record(ctx, ctx.rank, kStageLayoutInvalidIds, uint64_t(sh.bad));
}

__global__ void __launch_bounds__(kLayoutThreads) dispatch_layout_kernel(LayoutArgs a, WaitCtx ctx) {
  __shared__ LayoutShared sh;
  extern __shared__ int expert_count[];
  const int tid = threadIdx.x, lane = tid & 31;
  const int R = a.num_ranks, E = a.num_experts, L = E / R;
  for (int i = tid; i < E; i += blockDim.x) expert_count[i] = 0;
  if (tid < R) sh.rank_count[tid] = 0;
  if (tid == 0) sh.bad = 0;
  __syncthreads();

  int bad = 0;
  // the loop bound is the same for the whole block, so every lane reaches the ballots
  for (int chunk = blockIdx.x; chunk * kLayoutThreads < a.num_tokens; chunk += gridDim.x) {
    const int t = chunk * kLayoutThreads + tid;
    uint64_t mask = 0;
    if (t < a.num_tokens) {
      mask = token_ranks(a.topk_idx + int64_t(t) * a.topk, a.topk, E, L, expert_count, bad);
      write_in_rank(a.is_token_in_rank + int64_t(t) * R, mask, R);
    }
    for (int r = 0; r < R; ++r) {
      const uint32_t ballot = __ballot_sync(0xffffffffu, (mask >> r) & 1ull);
      if (lane == 0 && ballot != 0u) atomicAdd(&sh.rank_count[r], __popc(ballot));
    }
  }
  if (bad != 0) atomicAdd(&sh.bad, bad);
  __syncthreads();
  if (tid < R && sh.rank_count[tid] != 0) atomicAdd(a.tokens_per_rank + tid, sh.rank_count[tid]);
  for (int e = tid; e < E; e += blockDim.x)
    if (expert_count[e] != 0) atomicAdd(a.tokens_per_expert + e, expert_count[e]);
  if (sh.bad != 0) report_bad_ids(a, ctx, sh);  // block-uniform: read after the barrier above
}

}  // namespace

void launch_dispatch_layout(const LayoutArgs& a, const WaitCtx& ctx, cudaStream_t stream) {
  DC_HOST_ASSERT(a.num_ranks >= 1 && a.num_ranks <= kLayoutMaxRanks, "layout: num_ranks must be in [1, 64]");
  DC_HOST_ASSERT(a.num_experts >= 1 && a.num_experts % a.num_ranks == 0,
                 "layout: num_experts must be a positive multiple of num_ranks");
  DC_HOST_ASSERT(a.topk >= 0 && a.topk <= kTopkMax, "layout: topk must be in [0, 32]");
  DC_HOST_ASSERT(a.num_tokens >= 0, "layout: num_tokens must be >= 0");
  // the counts are sums of every block's atomics: they start at zero
  DC_CUDA_CHECK(cudaMemsetAsync(a.tokens_per_rank, 0, size_t(a.num_ranks) * sizeof(int), stream));
  DC_CUDA_CHECK(cudaMemsetAsync(a.tokens_per_expert, 0, size_t(a.num_experts) * sizeof(int), stream));
  if (a.num_tokens == 0) return;
  const int blocks = std::min((a.num_tokens + kLayoutThreads - 1) / kLayoutThreads, kLayoutMaxBlocks);
  const int smem = a.num_experts * int(sizeof(int));
  opt_in_dynamic_smem<dispatch_layout_kernel>(smem);
  dispatch_layout_kernel<<<blocks, kLayoutThreads, smem, stream>>>(a, ctx);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
