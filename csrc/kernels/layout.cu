// get_dispatch_layout on the GPU: one block, no communication.
#include "../runtime/cuda_check.hpp"
#include "../runtime/smem_opt_in.hpp"
#include "api.hpp"
#include "layout_block.cuh"

namespace dc {

__global__ void __launch_bounds__(kLayoutThreads, 1)
    dispatch_layout_kernel(const int64_t* topk_idx, int num_tokens, int topk, int num_experts, int num_ranks,
                           int* tokens_per_rank, int* tokens_per_expert, bool* is_token_in_rank, int* send_pos) {
  __shared__ LayoutShared sh;
  extern __shared__ int expert_count[];
  compute_layout_block(topk_idx, num_tokens, topk, num_experts, num_ranks, sh, expert_count, is_token_in_rank,
                       send_pos);
  write_layout_counts(sh, expert_count, num_experts, num_ranks, tokens_per_rank, tokens_per_expert);
}

void launch_dispatch_layout(const int64_t* topk_idx, int num_tokens, int topk, int num_experts, int num_ranks,
                            int* tokens_per_rank, int* tokens_per_expert, bool* is_token_in_rank, int* send_pos,
                            cudaStream_t stream) {
  DC_HOST_ASSERT(num_ranks >= 1 && num_ranks <= kLayoutMaxRanks, "layout: num_ranks must be in [1, 64]");
  DC_HOST_ASSERT(num_experts % num_ranks == 0, "layout: num_experts must be a multiple of num_ranks");
  opt_in_dynamic_smem<dispatch_layout_kernel>(num_experts * int(sizeof(int)));
  dispatch_layout_kernel<<<1, kLayoutThreads, num_experts * sizeof(int), stream>>>(
      topk_idx, num_tokens, topk, num_experts, num_ranks, tokens_per_rank, tokens_per_expert, is_token_in_rank,
      send_pos);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
