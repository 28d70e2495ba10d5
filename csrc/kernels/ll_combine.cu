// Low-latency combine over NVLink, two launches (hook mode holds no SM between them):
//   send: every received entry's expert output row goes back to its source rank, into comb_recv[slot][t][k];
//         one done flag per block at every rank;
//   recv: waits for every rank's flags, then per token: for each rank ascending, the sum over its slots
//         (ascending) of w * x, each product rounded on its own; the partials summed in fp32; one bf16 rounding.
#include <cuda_bf16.h>

#include "../runtime/cuda_check.hpp"
#include "../runtime/wait.cuh"
#include "api.hpp"
#include "block_flags.cuh"
#include "warp_copy.cuh"

namespace dc {

namespace {

constexpr int kLlCombineThreads = 512;

constexpr int kLlUnroll = 8;

// Only real entries are walked: the block first copies every (source, local expert) count into shared memory
// and prefix-sums the per-expert totals, then each warp maps its item to (expert, row) by binary search.
__global__ void __launch_bounds__(kLlCombineThreads, 1)
    ll_combine_send_kernel(const void* x, int topk, int slot, LlLayout layout, Peers peers, WaitCtx ctx_in) {
  const WaitCtx ctx = ctx_in.resolved();
  const int R = layout.num_ranks, E = layout.num_experts, L = layout.local_experts(), rank = ctx.rank;
  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t rows = layout.rows_per_expert(), n16 = layout.hidden / 8;
  uint8_t* self = peers.base[rank];
  extern __shared__ int sm[];
  int* cnt = sm;              // [R][L]
  int* prefix = sm + R * L;   // [L + 1] entries before each local expert
  const int* counts = reinterpret_cast<const int*>(self + layout.counts_at(slot));
  for (int i = tid; i < R * L; i += blockDim.x) cnt[i] = counts[(i / L) * E + rank * L + i % L];
  __syncthreads();
  if (tid == 0) {
    int acc = 0;
    for (int le = 0; le < L; ++le) {
      prefix[le] = acc;
      for (int s = 0; s < R; ++s) acc += cnt[s * L + le];
    }
    prefix[L] = acc;
  }
  __syncthreads();
  const int* recv_src = reinterpret_cast<const int*>(self + layout.recv_src_at(slot));
  const int warps = kLlCombineThreads / 32, total_warps = gridDim.x * warps;
  for (int item = blockIdx.x * warps + (tid >> 5); item < prefix[L]; item += total_warps) {
    int lo = 0, hi = L;  // last le with prefix[le] <= item
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (prefix[mid] <= item) lo = mid; else hi = mid;
    }
    const int le = lo, row = item - prefix[le];
    int src_rank = 0, begin = 0;
    while (src_rank + 1 < R && row >= begin + cnt[src_rank * L + le]) begin += cnt[(src_rank++) * L + le];
    const int64_t entry = int64_t(le) * rows + row;
    const int pair = recv_src[entry];
    const int t = pair / topk, k = pair % topk;
    const int4* src = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(x) + entry * layout.row_bytes());
    int4* dst = reinterpret_cast<int4*>(peers.base[src_rank] + layout.comb_recv_at(slot) +
                                        (int64_t(t) * layout.topk_max + k) * layout.row_bytes());
    warp_copy_v4<kLlUnroll>(src, dst, n16, lane);
  }
  __syncthreads();
  signal_block_done(peers, layout.comb_flag, R, ctx);
}

__global__ void __launch_bounds__(kLlCombineThreads, 1)
    ll_combine_recv_kernel(const int64_t* topk_idx, const float* topk_weights, void* out, int num_tokens, int topk,
                           int slot, int num_send_blocks, LlLayout layout, Peers peers, WaitCtx ctx_in) {
  const WaitCtx ctx = ctx_in.resolved();
  const int R = layout.num_ranks, L = layout.local_experts(), rank = ctx.rank;
  const int tid = threadIdx.x, lane = tid & 31;
  const int64_t n16 = layout.hidden / 8;
  uint8_t* self = peers.base[rank];
  __shared__ int ok;
  if (!wait_all_blocks_done(self, layout.comb_flag, R, num_send_blocks, ctx, kStageLlCombineData, &ok)) return;
  const uint8_t* rows = self + layout.comb_recv_at(slot);
  const int warps = kLlCombineThreads / 32;
  constexpr int U = 4;
  for (int t = blockIdx.x * warps + (tid >> 5); t < num_tokens; t += gridDim.x * warps) {
    // lane k holds slot k's owner rank (-1 for an empty slot) and weight
    const int64_t my_e = lane < topk ? topk_idx[int64_t(t) * topk + lane] : -1;
    const int my_owner = my_e >= 0 ? int(my_e / L) : -1;
    const float my_w = lane < topk ? topk_weights[int64_t(t) * topk + lane] : 0.0f;
    const int4* token_rows = reinterpret_cast<const int4*>(rows + int64_t(t) * layout.topk_max * layout.row_bytes());
    const int64_t row16 = layout.row_bytes() / 16;
    for (int64_t i0 = lane; i0 < n16; i0 += 32 * U) {
      float acc[U][8];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[u][j] = 0.0f;
      for (int d = 0; d < R; ++d) {
        float part[U][8];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int j = 0; j < 8; ++j) part[u][j] = 0.0f;
        for (int k = 0; k < topk; ++k) {
          if (__shfl_sync(0xffffffffu, my_owner, k) != d) continue;
          const float w = __shfl_sync(0xffffffffu, my_w, k);
          int4 v[U];
#pragma unroll
          for (int u = 0; u < U; ++u)
            if (i0 + u * 32 < n16) v[u] = ptx::ld_relaxed_gpu_v4(token_rows + k * row16 + i0 + u * 32);
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v[u]);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              const float2 f = __bfloat1622float2(h[j]);
              part[u][2 * j] = __fadd_rn(part[u][2 * j], __fmul_rn(w, f.x));
              part[u][2 * j + 1] = __fadd_rn(part[u][2 * j + 1], __fmul_rn(w, f.y));
            }
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[u][j] = __fadd_rn(acc[u][j], part[u][j]);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (i0 + u * 32 >= n16) break;
        int4 o;
        auto* oh = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
        for (int j = 0; j < 4; ++j) oh[j] = __floats2bfloat162_rn(acc[u][2 * j], acc[u][2 * j + 1]);
        reinterpret_cast<int4*>(static_cast<uint8_t*>(out) + int64_t(t) * layout.hidden * 2)[i0 + u * 32] = o;
      }
    }
  }
}

}  // namespace

void launch_ll_combine_send(const void* x, int topk, int slot, int num_blocks, const LlLayout& layout,
                            const Peers& peers, const WaitCtx& ctx, cudaStream_t stream) {
  DC_HOST_ASSERT(num_blocks >= 1 && num_blocks <= kMaxBlocks, "low_latency_combine: num_sms out of range");
  DC_HOST_ASSERT(topk <= layout.topk_max, "low_latency_combine: topk over the buffer's maximum");
  const int smem = (layout.num_ranks * layout.local_experts() + layout.local_experts() + 1) * int(sizeof(int));
  DC_HOST_ASSERT(smem <= 48 * 1024, "low_latency_combine: too many local experts");
  ll_combine_send_kernel<<<num_blocks, kLlCombineThreads, smem, stream>>>(x, topk, slot, layout, peers, ctx);
  DC_CUDA_CHECK(cudaGetLastError());
}

void launch_ll_combine_recv(const int64_t* topk_idx, const float* topk_weights, void* out, int num_tokens, int topk,
                            int slot, int num_send_blocks, const LlLayout& layout, const Peers& peers,
                            const WaitCtx& ctx, cudaStream_t stream) {
  const int blocks = max(1, min(num_send_blocks, (num_tokens + 15) / 16));
  ll_combine_recv_kernel<<<blocks, kLlCombineThreads, 0, stream>>>(topk_idx, topk_weights, out, num_tokens, topk,
                                                                  slot, num_send_blocks, layout, peers, ctx);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
