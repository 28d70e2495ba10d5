// A call this rank rejected before its kernels (its own validation raised): it still takes part in the call's
// first exchange, with its words (agreement.Word.REJECTED set), so every peer stops that call naming it instead of
// pairing the call with this rank's next one. Nothing else moves; the call numbers advance as the call's own
// first kernel would advance them. The same words-only send, compared, stands for a low-latency call of a new shape
// in the old buffer (deepcomm/cuda/ll_calls.py).
#include "../runtime/call_entry.cuh"
#include "../runtime/cuda_check.hpp"
#include "agree.cuh"
#include "api.hpp"
#include "ll_common.cuh"

namespace dc {

namespace {

// Normal mode: the call's first kernel, it advances the sequence number (call_entry.cuh), then our words go into
// every peer's agree slot for us. `compare`: then also wait for every peer's words and compare them with ours, as
// a call's first exchange does (a difference is recorded: agree_report), for a call that takes a normal-mode call
// number without running one (the first low-latency call: deepcomm/cuda/mode_meet.py).
__global__ void agree_reject_kernel(Fingerprint f, NvlLayout layout, Peers peers, WaitCtx ctx_in, bool compare) {
  uint8_t* self = peers.base[ctx_in.rank];
  auto* ticket = reinterpret_cast<uint32_t*>(self + layout.notify_work + NotifyWork::kEntryTicket);
  const WaitCtx ctx = enter_call(ctx_in, ticket);
  const int d = threadIdx.x;
  if (d < layout.num_ranks)
    agree_publish(peers.base[d] + layout.agree_at(ctx.seq) + int64_t(ctx.rank) * kAgreeSlotBytes, f, ctx.seq);
  if (compare && agree_on(f)) {
    __syncthreads();
    agree_block(self + layout.agree_at(ctx.seq), f, ctx.seq, layout.num_ranks, AllRanks{}, ctx, kStageAgree, true);
  }
}

// Low-latency mode: a send half of `kind` into `slot` that only publishes the words (tagged as that send's words
// are) and advances the call numbers as ll_finish_send does; no arrival word is raised (the peers stop on the words
// before they wait for any), except with put peers: there a dispatch's receive halves compare the words once the
// arrival words are in, so a rejected dispatch raises its `blocks` arrival words too (the host then puts the
// block's data and flags; a combine's words go with the weights put). `compare`: then also wait for every live
// peer's words and compare them with ours, as a receive half does (a difference is recorded: agree_report), for a
// call that will not run in this buffer (a new low-latency shape: the host learns whether every rank changed it).
// A buffer with put peers compares in a launch of its own instead (ll_agree_compare_kernel).
__global__ void ll_agree_reject_kernel(Fingerprint f, int kind, int slot, LlLayout l, LlPeers peers, WaitCtx ctx,
                                       bool compare, int blocks) {
  uint8_t* self = peers.at(ctx.rank);
  LlRanks alive;
  const LlKind k = LlKind(kind);
  const uint64_t calls = ll_enter<true>(self, l, k, slot, ctx, &alive);
  const uint64_t tag = k == kLlDispatch ? calls : ctx.seq;
  if (ll_agree_on(f, l)) ll_agree_publish(peers, l, alive, k, slot, ctx.rank, f, tag);
  if (ll_inbox_agree_on(f, l)) {
    ll_inbox_publish(peers, l, alive, k, slot, ctx.rank, f, tag);
    if (k == kLlDispatch) {
      __syncthreads();
      if (threadIdx.x == 0) ptx::fence_acq_rel_sys();  // the words before the arrival words (as ll_finish_send)
      __syncthreads();
      for (int i = threadIdx.x; i < l.num_ranks * blocks; i += blockDim.x) {
        const int d = i / blocks, b = i % blocks;
        if (ll_is_alive(alive, d) && d != ctx.rank)
          ptx::st_relaxed_sys_u64(reinterpret_cast<uint64_t*>(peers.at(d) + l.arrival_at(k, slot, ctx.rank, b)),
                                  calls);
      }
    }
  }
  __syncthreads();
  if (compare && ll_agree_on(f, l)) ll_agree(self, l, alive, k, slot, f, tag, ctx);
  if (threadIdx.x == 0) {
    reinterpret_cast<uint64_t*>(self + l.seq)[kind] = ctx.seq;
    reinterpret_cast<uint64_t*>(self + l.slot_seq)[kind * 2 + slot] = ctx.seq;
    reinterpret_cast<uint64_t*>(self + l.slot_calls)[kind * 2 + slot] = calls;
    __threadfence();
  }
}

// A buffer with put peers: after a words-only send half of `kind` into `slot` (ll_agree_reject_kernel) and the
// host's puts of its words, wait (bounded) for every live rank's words of that send in our inbox blocks and compare
// them with ours, as a receive half does (a difference is recorded: agree_report_rows). Not part of the send
// half's launch: our words reach a put peer only by the host's put, which follows that launch in stream order, and
// ranks that all changed the shape would each wait there for words no rank has put yet. The tag is the one the
// send half left for the slot, as a receive half reads it: a dispatch's send count, a combine's sequence number.
__global__ void ll_agree_compare_kernel(Fingerprint f, int kind, int slot, LlLayout l, LlPeers peers, WaitCtx ctx) {
  const uint8_t* self = peers.at(ctx.rank);
  LlRanks alive;
  const LlKind k = LlKind(kind);
  const uint64_t calls = ll_enter<false>(self, l, k, slot, ctx, &alive);
  const uint64_t tag = k == kLlDispatch ? calls : ctx.seq;
  if (ll_inbox_agree_on(f, l)) ll_inbox_agree(self, l, alive, k, slot, f, tag, ctx, true);
}

// The words-only kernels take a thread per rank (ll_agree_publish, agree_block).
constexpr int kLlAgreeThreads = kLlMaxRanks;

}  // namespace

void launch_agree_reject(const Fingerprint& words, const NvlLayout& layout, const Peers& peers, const WaitCtx& ctx,
                         cudaStream_t stream, bool compare) {
  DC_HOST_ASSERT(layout.num_ranks <= 32, "agree_reject: too many ranks");
  agree_reject_kernel<<<1, 32, 0, stream>>>(words, layout, peers, ctx, compare);
  DC_CUDA_CHECK(cudaGetLastError());
}

void launch_ll_agree_reject(const Fingerprint& words, int kind, int slot, const LlLayout& layout, const LlPeers& peers,
                            const WaitCtx& ctx, cudaStream_t stream, bool compare, int blocks) {
  DC_HOST_ASSERT(kind == kLlDispatch || kind == kLlCombine, "ll_agree_reject: kind must be 0 or 1");
  DC_HOST_ASSERT(slot == 0 || slot == 1, "ll_agree_reject: slot must be 0 or 1");
  DC_HOST_ASSERT(layout.num_ranks <= kLlMaxRanks, "ll_agree_reject: too many ranks");
  DC_HOST_ASSERT(blocks >= 0 && blocks <= kMaxBlocks, "ll_agree_reject: block count out of range");
  DC_HOST_ASSERT(!layout.with_outbox || kind != kLlDispatch || blocks >= 1,
                 "ll_agree_reject: a buffer with put peers needs the peers' block count");
  ll_agree_reject_kernel<<<1, kLlAgreeThreads, 0, stream>>>(words, kind, slot, layout, peers, ctx, compare, blocks);
  DC_CUDA_CHECK(cudaGetLastError());
}

void launch_ll_agree_compare(const Fingerprint& words, int kind, int slot, const LlLayout& layout, const LlPeers& peers,
                             const WaitCtx& ctx, cudaStream_t stream) {
  DC_HOST_ASSERT(kind == kLlDispatch || kind == kLlCombine, "ll_agree_compare: kind must be 0 or 1");
  DC_HOST_ASSERT(slot == 0 || slot == 1, "ll_agree_compare: slot must be 0 or 1");
  DC_HOST_ASSERT(layout.num_ranks <= kLlMaxRanks, "ll_agree_compare: too many ranks");
  DC_HOST_ASSERT(layout.with_outbox, "ll_agree_compare: only a buffer with put peers compares apart from the send");
  ll_agree_compare_kernel<<<1, kLlAgreeThreads, 0, stream>>>(words, kind, slot, layout, peers, ctx);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
