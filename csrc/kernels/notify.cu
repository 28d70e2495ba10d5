// Notify: the first kernel of a fresh dispatch. It computes this rank's layout, advances the call's sequence
// number, sends each peer our row of the count matrix and its experts' counts, collects everyone's, and tells
// the host what it must know (DispatchCounts in mapped host memory).
//
// The layout is spread over ceil(T / kNotifyChunk) blocks, one token per thread: each block takes a chunk of
// tokens, finds their ranks and experts, publishes its counts per rank, adds the counts of the chunks before its
// own to its tokens' positions (so send_pos is absolute as written), and adds its expert counts into NotifyWork.
// The last block to finish (a ticket) sums the totals and alone talks to peers. A single block skips NotifyWork
// and the ticket: its own counts are the totals.
#include "../runtime/cuda_check.hpp"
#include "../runtime/smem_opt_in.hpp"
#include "notify_phase.cuh"

namespace dc {

namespace {

using namespace notify_detail;

__global__ void __launch_bounds__(kNotifyThreads, 1)
    notify_dispatch_kernel(NotifyArgs a, NvlLayout layout, Peers peers, WaitCtx ctx_base) {
  uint64_t seq;
  const NotifyEnd end = notify_phase(a, layout, peers, ctx_base, int(gridDim.x), false, seq);
  // Stopped (the ranks' words differ, or a wait gave up: recorded): the payload behind us, launched before the
  // host knows, must move nothing. It reads this invalid count first; the count matrix it would otherwise read was
  // never written, and rows placed by it could land anywhere in a peer's output, or outside it.
  if (end == kNotifyStopped && threadIdx.x == 0) {
    const int R = layout.num_ranks;
    a.notify_out[NotifyOut(R, a.num_experts / R).bad_all] = -1;
  }
}

}  // namespace

void launch_notify_dispatch(const NotifyArgs& args, const NvlLayout& layout, const Peers& peers, const WaitCtx& ctx,
                            cudaStream_t stream) {
  check_notify_args(args, layout);
  const int blocks = notify_blocks(args.num_tokens);
  const int smem = notify_smem_bytes(args.num_experts);
  opt_in_dynamic_smem<notify_dispatch_kernel>(smem);
  notify_dispatch_kernel<<<blocks, kNotifyThreads, smem, stream>>>(args, layout, peers, ctx);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
