// Low-latency dispatch over NVLink, in two launches so hook mode holds no SM between them:
//   send: count exchange (every rank broadcasts its per-expert entry counts), then each warp takes a
//         (token, slot) entry and stores it, cast to e4m3 inside the kernel when asked, straight into the owner's
//         receive rows; one done flag per block at every rank. It never waits for anyone's data.
//   recv: waits for every rank's done flags, then writes recv_count, layout and src_info.
#include <cuda_bf16.h>

#include "../runtime/cuda_check.hpp"
#include "../runtime/wait.cuh"
#include "api.hpp"
#include "block_flags.cuh"
#include "fp8_cast.cuh"
#include "warp_copy.cuh"

namespace dc {

namespace {

constexpr int kLlThreads = 512;
constexpr int kLlUnroll = 8;  // 16-byte vectors (BF16) or 128-element blocks (FP8) each lane has in flight

__global__ void __launch_bounds__(kLlThreads, 1)
    ll_dispatch_send_kernel(LlDispatchArgs a, LlLayout layout, Peers peers, WaitCtx ctx_in) {
  const WaitCtx ctx = ctx_in.resolved();
  extern __shared__ int smem[];
  const int R = layout.num_ranks, E = layout.num_experts, L = layout.local_experts(), rank = ctx.rank;
  const int K = a.topk, P = a.num_tokens * K, tid = threadIdx.x, lane = tid & 31;
  const int64_t rows = layout.rows_per_expert();
  int* experts = smem;          // [P] expert of each entry, -1 for empty slots
  int* rank_in = smem + P;      // [P] entries of ours before it for the same expert (only this block's entries)
  int* counts = smem + 2 * P;   // [E] our entries per expert (block 0)
  int* base = smem + 2 * P + E; // [E] entries of lower ranks per expert
  __shared__ int ok;
  const int warps = kLlThreads / 32, total_warps = gridDim.x * warps;
  const int first_warp = blockIdx.x * warps;

  for (int i = tid; i < P; i += blockDim.x) {
    const int64_t e = a.topk_idx[i];
    experts[i] = (e >= 0 && e < E) ? int(e) : -1;
  }
  for (int i = tid; i < E; i += blockDim.x) counts[i] = 0;
  if (tid == 0) ok = 1;
  __syncthreads();
  // Ranks among same-expert entries, in (token, slot) order, for the entries this block sends.
  for (int p = tid; p < P; p += blockDim.x) {
    const int e = experts[p];
    const bool mine = ((p % total_warps) / warps) == int(blockIdx.x);
    if (e >= 0 && (mine || blockIdx.x == 0)) {
      int r = 0;
      for (int j = 0; j < p; ++j) r += experts[j] == e;
      rank_in[p] = r;
    }
    if (blockIdx.x == 0 && e >= 0) atomicAdd(&counts[e], 1);
  }
  __syncthreads();

  uint8_t* self = peers.base[rank];
  if (blockIdx.x == 0) {
    for (int i = tid; i < R * E; i += blockDim.x) {
      int* dst = reinterpret_cast<int*>(peers.base[i / E] + layout.counts_at(a.slot));
      dst[rank * E + i % E] = counts[i % E];
    }
    __syncthreads();
    if (tid < R) {
      ptx::fence_acq_rel_sys();
      ptx::st_release_sys_u64(reinterpret_cast<uint64_t*>(peers.base[tid] + layout.count_flag) + rank, ctx.seq);
    }
  }
  if (tid < R) {
    const auto* flag = reinterpret_cast<const uint64_t*>(self + layout.count_flag) + tid;
    if (!wait_flag_geq(flag, ctx.seq, ctx, tid, kStageLlCounts)) ok = 0;
  }
  __syncthreads();
  if (!ok) return;
  const int* all_counts = reinterpret_cast<const int*>(self + layout.counts_at(a.slot));
  for (int e = tid; e < E; e += blockDim.x) {
    int b = 0;
    for (int s = 0; s < rank; ++s) b += ptx::ld_volatile_s32(all_counts + s * E + e);
    base[e] = b;
  }
  __syncthreads();
  if (blockIdx.x == 0)
    for (int p = tid; p < P; p += blockDim.x) a.recv_pos[p] = experts[p] >= 0 ? base[experts[p]] + rank_in[p] : -1;

  const int64_t H = layout.hidden, row_stride = a.use_fp8 ? H : H * 2, blocks128 = H / 128;
  for (int p = first_warp + (tid >> 5); p < P; p += total_warps) {
    const int e = experts[p];
    if (e < 0) continue;
    const int d = e / L, le = e % L, t = p / K;
    const int64_t entry = int64_t(le) * rows + base[e] + rank_in[p];
    uint8_t* dst = peers.base[d] + layout.recv_x_at(a.slot) + entry * row_stride;
    const auto* src = static_cast<const __nv_bfloat16*>(a.x) + int64_t(t) * H;
    if (!a.use_fp8) {
      warp_copy_v4<kLlUnroll>(reinterpret_cast<const int4*>(src), reinterpret_cast<int4*>(dst), H / 8, lane);
    } else {
      float* scales = reinterpret_cast<float*>(peers.base[d] + layout.recv_scales_at(a.slot)) + entry * blocks128;
      for (int64_t blk0 = 0; blk0 < blocks128; blk0 += kLlUnroll) {
        uint2 raw[kLlUnroll];
#pragma unroll
        for (int u = 0; u < kLlUnroll; ++u)
          if (blk0 + u < blocks128) raw[u] = __ldg(reinterpret_cast<const uint2*>(src + (blk0 + u) * 128) + lane);
#pragma unroll
        for (int u = 0; u < kLlUnroll; ++u) {
          if (blk0 + u >= blocks128) break;
          const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[u].x));
          const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[u].y));
          const float v[4] = {lo.x, lo.y, hi.x, hi.y};
          float scale;
          const uint32_t q = quantize_block_e4m3(v, a.use_ue8m0, &scale);
          reinterpret_cast<uint32_t*>(dst + (blk0 + u) * 128)[lane] = q;
          if (lane == 0) scales[blk0 + u] = scale;
        }
      }
    }
    if (lane == 0) reinterpret_cast<int*>(peers.base[d] + layout.recv_src_at(a.slot))[entry] = p;
  }
  __syncthreads();
  signal_block_done(peers, layout.data_flag, R, ctx);
}

__global__ void ll_dispatch_recv_kernel(int slot, int topk, int num_send_blocks, int* recv_count, int* layout_out,
                                        int* src_info, LlLayout layout, Peers peers, WaitCtx ctx_in) {
  const WaitCtx ctx = ctx_in.resolved();
  const int R = layout.num_ranks, E = layout.num_experts, L = layout.local_experts(), rank = ctx.rank;
  const int le = blockIdx.x, tid = threadIdx.x;
  const int64_t rows = layout.rows_per_expert();
  uint8_t* self = peers.base[rank];
  __shared__ int ok, total;
  if (!wait_all_blocks_done(self, layout.data_flag, R, num_send_blocks, ctx, kStageLlDispatchData, &ok)) return;
  const int* counts = reinterpret_cast<const int*>(self + layout.counts_at(slot));
  if (tid == 0) {
    int begin = 0;
    for (int s = 0; s < R; ++s) {
      const int c = ptx::ld_volatile_s32(counts + s * E + rank * L + le);
      layout_out[(le * R + s) * 2] = begin;
      layout_out[(le * R + s) * 2 + 1] = c;
      begin += c;
    }
    recv_count[le] = begin;
    total = begin;
  }
  __syncthreads();
  const int* src = reinterpret_cast<const int*>(self + layout.recv_src_at(slot)) + le * rows;
  for (int64_t row = tid; row < rows; row += blockDim.x)
    src_info[le * rows + row] = row < total ? ptx::ld_volatile_s32(src + row) / topk : -1;
}

}  // namespace

void launch_ll_dispatch_send(const LlDispatchArgs& args, int num_blocks, const LlLayout& layout, const Peers& peers,
                             const WaitCtx& ctx, cudaStream_t stream) {
  DC_HOST_ASSERT(num_blocks >= 1 && num_blocks <= kMaxBlocks, "low_latency_dispatch: num_sms out of range");
  DC_HOST_ASSERT(args.num_tokens <= layout.max_tokens && args.topk <= layout.topk_max,
                 "low_latency_dispatch: tokens or topk over the buffer's maximum");
  DC_HOST_ASSERT(layout.hidden % 128 == 0, "low_latency_dispatch: hidden must be a multiple of 128");
  const int smem = (2 * args.num_tokens * args.topk + 2 * layout.num_experts) * int(sizeof(int));
  DC_HOST_ASSERT(smem <= 200 * 1024, "low_latency_dispatch: tokens * topk too large for one block's shared memory");
  if (smem > 48 * 1024)
    DC_CUDA_CHECK(cudaFuncSetAttribute(ll_dispatch_send_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  ll_dispatch_send_kernel<<<num_blocks, kLlThreads, smem, stream>>>(args, layout, peers, ctx);
  DC_CUDA_CHECK(cudaGetLastError());
}

void launch_ll_dispatch_recv(int slot, int topk, int num_send_blocks, int* recv_count, int* layout_out, int* src_info,
                             const LlLayout& layout, const Peers& peers, const WaitCtx& ctx, cudaStream_t stream) {
  ll_dispatch_recv_kernel<<<layout.local_experts(), 256, 0, stream>>>(slot, topk, num_send_blocks, recv_count,
                                                                      layout_out, src_info, layout, peers, ctx);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
