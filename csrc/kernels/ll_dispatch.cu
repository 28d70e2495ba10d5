// Low-latency dispatch over NVLink: one kernel with both halves when there is no hook, or the two halves as two
// launches so hook mode holds no SM between them:
//   send: each token goes once to every rank that holds any of its experts (cast to e4m3 once, inside the kernel,
//         when asked), into that rank's staging rows for us. Each row block takes a contiguous range of tokens
//         and also sends, per slot of its tokens, one int telling the receiver which of its experts the slot names
//         and the entry's rank there (ranked on top of a histogram of the entries before the range); block 0 sends
//         the per-expert counts. Nothing is waited for: no count exchange precedes the data, and each block's
//         arrival word covers its rows and metadata alike.
//   recv: polls the tagged counts (they land first) for the expert bases, waits for the arrival words of every
//         block of every rank, then fans each staged token out to the packed rows of its local experts (source
//         ranks ascending, then the sender's entry order), records where each entry landed (for the combine), and
//         writes recv_count, layout, src_info and recv_pos as views the host hands out.
// The halves live in ll_dispatch_send.cuh and ll_dispatch_recv.cuh; this file holds the kernel and its launcher.

#include "../runtime/cuda_check.hpp"
#include "../runtime/pdl_launch.hpp"
#include "../runtime/smem_opt_in.hpp"
#include "api.hpp"
#include "ll_common.cuh"
#include "ll_dispatch_recv.cuh"
#include "ll_dispatch_send.cuh"

namespace dc {

namespace {

template <int kPhases>
__global__ void __launch_bounds__(kLlThreads, 1)
    ll_dispatch_kernel(LlDispatchArgs a, LlLayout l, LlPeers peers, WaitCtx ctx) {
  constexpr bool kSend = kPhases & kLlSendPhase, kRecv = kPhases & kLlRecvPhase;
  ll_gate(a.pdl);
  const SendRange range(a, l);
  RowItem r;
  if (kSend) range.load_first(a, l, r);
  LlRanks alive;
  const uint64_t calls = ll_enter<kSend>(peers.at(ctx.rank), l, kLlDispatch, a.slot, ctx, &alive);
  ll_trace(a.trace, kLlTraceEntry);
  extern __shared__ int smem[];
  if (kSend) dispatch_send_phase(a, l, peers, ctx, alive, calls, smem, range, r);
  if (kRecv) dispatch_recv_phase(a, l, peers, ctx, alive, calls, smem);  // smem reused: the send half is done
}

template <int kPhases>
void launch_phases(const LlDispatchArgs& args, int num_blocks, int smem, const LlLayout& layout, const LlPeers& peers,
                   const WaitCtx& ctx, cudaStream_t stream) {
  opt_in_dynamic_smem<ll_dispatch_kernel<kPhases>>(smem);
  launch_kernel(ll_dispatch_kernel<kPhases>, num_blocks, kLlThreads, smem, stream, args.pdl != 0, args, layout, peers,
                ctx);
}

}  // namespace

void launch_ll_dispatch(const LlDispatchArgs& args, int phases, int num_blocks, const LlLayout& layout,
                        const LlPeers& peers, const WaitCtx& ctx, cudaStream_t stream) {
  DC_HOST_ASSERT(num_blocks >= 1 && num_blocks <= kMaxBlocks, "low_latency_dispatch: block count out of range");
  DC_HOST_ASSERT(args.num_tokens <= layout.max_tokens && args.topk <= layout.topk_max,
                 "low_latency_dispatch: tokens or topk over the buffer's maximum");
  DC_HOST_ASSERT(layout.hidden % 128 == 0, "low_latency_dispatch: hidden must be a multiple of 128");
  DC_HOST_ASSERT(layout.max_tokens <= 0xffff && layout.num_experts <= 0x7fff,
                 "low_latency_dispatch: entry keys pack 16-bit ranks and 15-bit experts");
  DC_HOST_ASSERT(int64_t(layout.local_experts()) * layout.rows_per_expert() < (int64_t(1) << 31),
                 "low_latency_dispatch: local experts * ranks * max tokens must stay below 2^31");
  // the send half's shared memory: a row block's range metadata (send_range_meta), or the counts (E ints)
  const int row_blocks = num_blocks > 1 ? num_blocks - 1 : 1;
  const int range_entries = (args.num_tokens + row_blocks - 1) / row_blocks * args.topk;
  const int send_smem = send_smem_ints(range_entries, layout.num_experts) * int(sizeof(int));  // >= E: the counts
  const int recv_smem = (layout.local_experts() * (layout.num_ranks + 1) + layout.num_ranks) * int(sizeof(int));
  DC_HOST_ASSERT(send_smem <= 200 * 1024,
                 "low_latency_dispatch: tokens * topk per block, or experts, too many for one block's shared memory");
  DC_HOST_ASSERT(recv_smem <= 200 * 1024, "low_latency_dispatch: too many local experts");
  switch (phases) {
    case kLlSendPhase: launch_phases<kLlSendPhase>(args, num_blocks, send_smem, layout, peers, ctx, stream); break;
    case kLlRecvPhase: launch_phases<kLlRecvPhase>(args, num_blocks, recv_smem, layout, peers, ctx, stream); break;
    case kLlBothPhases:
      launch_phases<kLlBothPhases>(args, num_blocks, send_smem > recv_smem ? send_smem : recv_smem, layout, peers, ctx,
                                   stream);
      break;
    default: DC_HOST_ASSERT(false, "low_latency_dispatch: phases must be 1 (send), 2 (receive) or 3 (both)");
  }
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
