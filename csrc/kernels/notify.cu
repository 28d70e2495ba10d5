// Notify: compute this rank's layout, send each peer our row of the count matrix and its experts' counts,
// and collect everyone's. One block; the count exchange is a handful of NVLink stores and flags.
#include "../runtime/cuda_check.hpp"
#include "../runtime/smem_opt_in.hpp"
#include "../runtime/wait.cuh"
#include "api.hpp"
#include "layout_block.cuh"

namespace dc {

__global__ void __launch_bounds__(kLayoutThreads, 1)
    notify_dispatch_kernel(const int64_t* topk_idx, int num_tokens, int topk, int num_experts, int* tokens_per_rank,
                           int* tokens_per_expert, bool* is_token_in_rank, int* send_pos, int* notify_out,
                           NvlLayout layout, Peers peers, WaitCtx ctx_in) {
  const WaitCtx ctx = ctx_in.resolved();
  __shared__ LayoutShared sh;
  extern __shared__ int expert_count[];
  const int R = layout.num_ranks, L = num_experts / R, rank = ctx.rank, tid = threadIdx.x;
  compute_layout_block(topk_idx, num_tokens, topk, num_experts, R, sh, expert_count, is_token_in_rank, send_pos);
  write_layout_counts(sh, expert_count, num_experts, R, tokens_per_rank, tokens_per_expert);

  // Our row of the count matrix, each peer's expert counts and our count of invalid expert ids go to row
  // `rank` of its notify_counts, so every rank learns when any rank's input was bad and all of them stop.
  const int row_len = R + L + 1;
  for (int i = tid; i < R * row_len; i += blockDim.x) {
    const int dst = i / row_len, j = i % row_len;
    const int v = j < R ? sh.rank_total[j] : (j < R + L ? expert_count[dst * L + (j - R)] : sh.invalid);
    reinterpret_cast<int*>(peers.base[dst] + layout.notify_counts)[rank * row_len + j] = v;
  }
  __syncthreads();
  if (tid < R) {
    ptx::fence_acq_rel_sys();
    ptx::st_release_sys_u64(reinterpret_cast<uint64_t*>(peers.base[tid] + layout.notify_flag) + rank, ctx.seq);
  }
  uint8_t* self = peers.base[rank];
  __shared__ int ok;
  if (tid == 0) ok = 1;
  __syncthreads();
  if (tid < R) {
    const auto* flag = reinterpret_cast<const uint64_t*>(self + layout.notify_flag) + tid;
    if (!wait_flag_geq(flag, ctx.seq, ctx, tid, kStageNotifyCounts)) ok = 0;
  }
  __syncthreads();
  if (!ok) return;
  const int* counts = reinterpret_cast<const int*>(self + layout.notify_counts);
  for (int i = tid; i < R * R; i += blockDim.x) notify_out[i] = ptx::ld_volatile_s32(counts + (i / R) * row_len + i % R);
  for (int l = tid; l < L; l += blockDim.x) {
    int sum = 0;
    for (int s = 0; s < R; ++s) sum += ptx::ld_volatile_s32(counts + s * row_len + R + l);
    notify_out[R * R + l] = sum;
  }
  if (tid == 0) {
    int bad = 0;
    for (int s = 0; s < R; ++s) bad += ptx::ld_volatile_s32(counts + s * row_len + R + L);
    notify_out[R * R + L] = bad;
    notify_out[R * R + L + 1] = sh.invalid;
  }
}

void launch_notify_dispatch(const int64_t* topk_idx, int num_tokens, int topk, int num_experts, int* tokens_per_rank,
                            int* tokens_per_expert, bool* is_token_in_rank, int* send_pos, int* notify_out,
                            const NvlLayout& layout, const Peers& peers, const WaitCtx& ctx, cudaStream_t stream) {
  DC_HOST_ASSERT(layout.num_ranks <= kMaxRanks, "notify: too many ranks for the NVLink transport");
  DC_HOST_ASSERT(num_experts % layout.num_ranks == 0 && num_experts / layout.num_ranks <= layout.num_local_experts,
                 "notify: num_experts is over the buffer's capacity");
  opt_in_dynamic_smem<notify_dispatch_kernel>(num_experts * int(sizeof(int)));
  notify_dispatch_kernel<<<1, kLayoutThreads, num_experts * sizeof(int), stream>>>(
      topk_idx, num_tokens, topk, num_experts, tokens_per_rank, tokens_per_expert, is_token_in_rank, send_pos,
      notify_out, layout, peers, ctx);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
