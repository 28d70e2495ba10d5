// Notify: the first kernel of a fresh dispatch. It computes this rank's layout, advances the call's sequence
// number, sends each peer our row of the count matrix and its experts' counts, collects everyone's, and tells
// the host what it must know (DispatchCounts in mapped host memory).
//
// The layout is spread over ceil(T / kNotifyChunk) blocks, one token per thread: each block finds its tokens'
// ranks and experts, their positions among the block's tokens, and adds its counts into NotifyWork. The last
// block to finish (a ticket) turns block counts into prefixes, makes send_pos absolute, and alone talks to peers.
// A single block skips NotifyWork and the ticket: its own counts are the totals.
#include "../runtime/cuda_check.hpp"
#include "../runtime/smem_opt_in.hpp"
#include "notify_phase.cuh"

namespace dc {

namespace {

using namespace notify_detail;

__global__ void __launch_bounds__(kNotifyThreads, 1)
    notify_dispatch_kernel(NotifyArgs a, NvlLayout layout, Peers peers, WaitCtx ctx_base) {
  notify_phase(a, layout, peers, ctx_base, int(gridDim.x), 0);
}

}  // namespace

void launch_notify_dispatch(const NotifyArgs& args, const NvlLayout& layout, const Peers& peers, const WaitCtx& ctx,
                            cudaStream_t stream) {
  check_notify_args(args, layout);
  const int blocks = notify_blocks(args.num_tokens);
  const int smem = notify_smem_bytes(args.num_experts, blocks, layout.num_ranks);
  opt_in_dynamic_smem<notify_dispatch_kernel>(smem);
  notify_dispatch_kernel<<<blocks, kNotifyThreads, smem, stream>>>(args, layout, peers, ctx);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
