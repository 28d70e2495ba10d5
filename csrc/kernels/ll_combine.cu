// Low-latency combine over NVLink: one kernel with both halves when there is no hook, or two launches (hook mode
// holds no SM between them):
//   send: every rank first publishes its top-k weights to every other rank. Then, for each token of each other
//         source rank that has entries here (where they landed is in the dispatch's entry table), the expert side
//         sums w * x over its slots (ascending, each product rounded on its own, in fp32) and stores that one
//         partial into the source's partials area: one row per (token, rank) instead of one per (token, expert),
//         as bf16 (or e4m3 + scales with the FP8 combine).
//   recv: sums our own partial the same way straight from the expert rows (never stored; a warp's first one before
//         the wait), waits for every rank's arrival words, then out[t] = partials of the ranks holding t's experts,
//         summed in rank order in fp32 and rounded once to bf16 (the reference backend's order, so the result is
//         bit-exact).
#include <cuda_bf16.h>

#include "../runtime/cuda_check.hpp"
#include "../runtime/pdl_launch.hpp"
#include "api.hpp"
#include "bf16_vec.cuh"
#include "combine_fp8.cuh"
#include "fp8_cast.cuh"
#include "ll_common.cuh"

namespace dc {

namespace {

constexpr int kUnroll = 4;                    // 8-element vectors per lane per item
constexpr int kChunk = 32 * 8 * kUnroll;      // elements of a row one warp handles per item
constexpr int kRows = 4;                      // expert rows of one token loaded at once

// acc = sum over the slots in `mine` (ascending) of w_k * x[entry_k], chunk c, each product rounded on its own and
// added in fp32 from zero: one token's partial for one rank. Lane k holds slot k's row in `entry`. Rows are loaded
// kRows at a time, all in flight before the first is accumulated; weight(&w) is asked for lane k's weight once
// the first rows are on their way, and false from it (a timed-out wait) ends the sum with false.
template <typename Weight>
__device__ __forceinline__ bool sum_expert_rows(const LlCombineArgs& a, int64_t H, int c, int64_t entry,
                                                uint32_t mine, Weight weight, float (&acc)[kUnroll][8]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[u][j] = 0.0f;
  int4 v[kRows][kUnroll];
  auto load_group = [&](uint32_t m) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (!m) break;
      const int64_t e = __shfl_sync(0xffffffffu, entry, __ffs(m) - 1);
      const auto* row = static_cast<const __nv_bfloat16*>(a.x) + e * H;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t idx = int64_t(c) * kChunk + u * 256 + lane * 8;
        v[r][u] = idx < H ? ptx::ld_nc_na_v4(reinterpret_cast<const int4*>(row + idx)) : make_int4(0, 0, 0, 0);
      }
      m &= m - 1;
    }
  };
  load_group(mine);
  float w;
  if (!weight(&w)) return false;
  for (uint32_t m = mine; m;) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (!m) break;
      const float wk = __shfl_sync(0xffffffffu, w, __ffs(m) - 1);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float f[8];
        unpack_bf16x8(v[r][u], f);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[u][j] = __fadd_rn(acc[u][j], __fmul_rn(wk, f[j]));
      }
      m &= m - 1;
    }
    if (m) load_group(m);
  }
  return true;
}

// Our weights to every other rank, each tagged with this call: one 8-byte store carries both, so a reader that sees
// the tag sees the weight, with no flag and no fence to wait for. (A put peer gets them in our outbox; with put
// peers the weights phase stores them once ahead of the send half, so the host can put them first.)
__device__ __forceinline__ void store_weights(const LlCombineArgs& a, const LlLayout& l, const LlPeers& peers,
                                              const WaitCtx& ctx, LlRanks alive) {
  const int R = l.num_ranks, rank = ctx.rank, K = a.topk, T = a.num_tokens;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < R * T * K; i += gridDim.x * blockDim.x) {
    const int d = i / (T * K), j = i % (T * K);
    if (!ll_is_alive(alive, d) || d == rank) continue;
    auto* word = reinterpret_cast<uint64_t*>(peers.at(d) + l.weights_at(a.slot, rank, j / K)) + j % K;
    ptx::st_relaxed_sys_u64(word, ll_tagged(ctx.seq, __float_as_int(a.topk_weights[j])));
  }
}

// The send half serves the other ranks only: our own tokens' partial is summed by the receive half, straight from
// the expert rows (the same sum, so the result is the same bit for bit), and never stored.
__device__ __forceinline__ void combine_send_phase(const LlCombineArgs& a, const LlLayout& l, const LlPeers& peers,
                                                   const WaitCtx& ctx, LlRanks alive, uint64_t calls, int* smem) {
  const int R = l.num_ranks, rank = ctx.rank;
  const int K = a.topk, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t H = l.hidden;
  uint8_t* self = peers.at(rank);
  int* n = smem;  // [R] tokens each other source dispatched in this slot (0 for masked ranks and for us)
  __shared__ int ok, items;
  if (tid == 0) ok = 1;
  ll_load_ntok(self, l, a.slot, alive.without(rank), n);

  const bool agree = ll_agree_on(a.agree, l), inbox_agree = ll_inbox_agree_on(a.agree, l);
  if (agree && blockIdx.x == 0) ll_agree_publish(peers, l, alive, kLlCombine, a.slot, rank, a.agree, ctx.seq);
  store_weights(a, l, peers, ctx, alive);
  // with put peers the weights phase published them already (put with the weights); the same words again here
  if (inbox_agree && blockIdx.x == 0) ll_inbox_publish(peers, l, alive, kLlCombine, a.slot, rank, a.agree, ctx.seq);
  const int nchunks = int((H + kChunk - 1) / kChunk);
  __syncthreads();
  // every rank's words before any partial leaves: on a difference no rank sends (the arrivals stay unsignalled,
  // and every receive half stops on the same comparison)
  if ((agree && !ll_agree(self, l, alive, kLlCombine, a.slot, a.agree, ctx.seq, ctx)) ||
      (inbox_agree && !ll_inbox_agree(self, l, alive, kLlCombine, a.slot, a.agree, ctx.seq, ctx, true))) {
    if (tid == 0) ok = 0;
    ll_finish_send(self, peers, l, kLlCombine, a.slot, ctx.seq, calls, rank, alive, &ok, a.trace);
    return;
  }
  if (tid == 0) items = ll_item_count(n, R, nchunks);
  __syncthreads();
  ll_trace(a.trace, kLlTraceWeights);

  // Warps take (source rank, token, chunk) items; the expert rows of an item's slots were recorded by the
  // dispatch's receive (entry table). The next item's entries are loaded while this one is summed.
  const int total_warps = gridDim.x * kLlWarps;
  auto load_entry = [&](int item, int* s, int* t, int* c) {
    int rest;
    ll_item_source(n, R, nchunks, item, s, &rest);
    *t = rest / nchunks;
    *c = rest % nchunks;
    return lane < K ? ptx::ld_volatile_s32(reinterpret_cast<const int*>(self + l.entry_at(a.slot, *s, *t)) + lane)
                    : -1;
  };
  int item = blockIdx.x * kLlWarps + warp, s = 0, t = 0, c = 0;
  int next = item < items ? load_entry(item, &s, &t, &c) : -1;
  for (; item < items; item += total_warps) {
    const int64_t entry = next;
    const int cs = s, ct = t, cc = c;
    if (item + total_warps < items) next = load_entry(item + total_warps, &s, &t, &c);
    const uint32_t mine = __ballot_sync(0xffffffffu, entry >= 0);
    if (!mine) continue;
    // the source's weights for this token, waited for once its first rows are on their way
    auto weight = [&](float* w) {
      int bits = 0;
      bool have = true;
      if (entry >= 0) {
        const auto* wp = reinterpret_cast<const uint64_t*>(self + l.weights_at(a.slot, cs, ct)) + lane;
        bits = ll_tagged_value(wp, ptx::ld_relaxed_sys_u64(wp), ctx.seq, ctx, cs, kStageLlCombineWeights, &have);
      }
      *w = __int_as_float(bits);
      return __all_sync(0xffffffffu, have);
    };
    float acc[kUnroll][8];
    if (!sum_expert_rows(a, H, cc, entry, mine, weight, acc)) {
      ok = 0;
      break;
    }
    uint8_t* dst = peers.at(cs) + l.partials_at(a.slot, rank, ct);
    if (a.use_fp8) {  // FP8 on the wire: e4m3 [H] then fp32 scales [H/128] in the partial's row
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t idx = int64_t(cc) * kChunk + u * 256 + lane * 8;
        float scale;
        const uint2 q = quantize8_e4m3(acc[u], false, &scale);  // every lane: the amax is shuffled
        if (idx >= H) continue;
        ptx::st_na_u64(reinterpret_cast<uint64_t*>(dst + idx), (uint64_t(q.y) << 32) | q.x);
        if ((lane & 15) == 0) reinterpret_cast<float*>(dst + H)[idx / 128] = scale;
      }
    } else {  // bf16: the partial rounded once, as the reference does
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t idx = int64_t(cc) * kChunk + u * 256 + lane * 8;
        if (idx < H) ptx::st_na_v4(reinterpret_cast<int4*>(dst + idx * 2), round_bf16x8(acc[u]));
      }
    }
  }
  ll_trace(a.trace, kLlTraceSendData);
  ll_finish_send(self, peers, l, kLlCombine, a.slot, ctx.seq, calls, rank, alive, &ok, a.trace);
}

// Our own partial of token t, chunk c (zero when no local expert holds it): our weights are at hand, and where the
// token's entries landed here is in the dispatch's entry table (source = us).
__device__ __forceinline__ void own_partial(const LlCombineArgs& a, const LlLayout& l, const uint8_t* self, int rank,
                                            int t, int c, float (&acc)[kUnroll][8]) {
  const int lane = threadIdx.x & 31, K = a.topk;
  const int64_t entry =
      lane < K ? ptx::ld_volatile_s32(reinterpret_cast<const int*>(self + l.entry_at(a.slot, rank, t)) + lane) : -1;
  const uint32_t mine = __ballot_sync(0xffffffffu, entry >= 0);
  auto weight = [&](float* w) {
    *w = lane < K ? a.topk_weights[int64_t(t) * K + lane] : 0.0f;
    return true;
  };
  sum_expert_rows(a, l.hidden, c, entry, mine, weight, acc);  // all zeros when mine is empty
}

// calls: the slot's send count this receive waits for (every rank's). A warp's first item has its own partial
// summed before the wait: it needs nothing from the peers.
__device__ __forceinline__ void combine_recv_phase(const LlCombineArgs& a, const LlLayout& l, const LlPeers& peers,
                                                   const WaitCtx& ctx, LlRanks alive, uint64_t calls) {
  const int E = l.num_experts, L = l.local_experts(), rank = ctx.rank;
  const int K = a.topk, T = a.num_tokens, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t H = l.hidden;
  const uint8_t* self = peers.at(rank);
  const int nchunks = int((H + kChunk - 1) / kChunk);
  const int total_warps = gridDim.x * kLlWarps, first = blockIdx.x * kLlWarps + warp;
  auto owners_of = [&](int t) {
    const int64_t e = lane < K ? a.topk_idx[int64_t(t) * K + lane] : -1;
    const int d = ll_slot_rank(e >= 0 && e < E ? int(e) : -1, L);
    return d != kLlNoRank && ll_is_alive(alive, d) ? d : kLlNoRank;
  };
  float own[kUnroll][8];
  int first_owners = kLlNoRank;  // a destination list (ll_slot_rank)
  if (first < T * nchunks) {
    first_owners = owners_of(first / nchunks);
    if (ll_has_rank(first_owners, rank)) own_partial(a, l, self, rank, first / nchunks, first % nchunks, own);
  }
  if (ll_agree_on(a.agree, l) && !ll_agree(self, l, alive, kLlCombine, a.slot, a.agree, ctx.seq, ctx)) return;
  if (ll_inbox_agree_on(a.agree, l) && !ll_inbox_agree(self, l, alive, kLlCombine, a.slot, a.agree, ctx.seq, ctx, true))
    return;
  if (!ll_wait_arrivals(self, l, kLlCombine, a.slot, calls, alive, ctx, kStageLlCombineData)) return;
  ll_trace(a.trace, kLlTraceArrived);
  for (int item = first; item < T * nchunks; item += total_warps) {
    const int t = item / nchunks, c = item % nchunks;
    const int owners = item == first ? first_owners : owners_of(t);
    if (item != first && ll_has_rank(owners, rank)) own_partial(a, l, self, rank, t, c, own);
    float acc[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[u][j] = 0.0f;
    LlDestWalk walk(owners);
    for (int d; (d = walk.next()) != kLlNoRank;) {  // ranks ascending
      const uint8_t* row = self + l.partials_at(a.slot, d, t);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t idx = int64_t(c) * kChunk + u * 256 + lane * 8;
        if (idx >= H) continue;
        float p[8];
        if (d == rank) {
#pragma unroll
          for (int j = 0; j < 8; ++j) p[j] = own[u][j];
        } else if (a.use_fp8) {  // dequantize (one rounded multiply each), then add
          const uint2 raw = ptx::ld_relaxed_gpu_v2(reinterpret_cast<const uint2*>(row + idx));
          const float scale = __int_as_float(ptx::ld_volatile_s32(reinterpret_cast<const int*>(row + H) + idx / 128));
#pragma unroll
          for (int j = 0; j < 8; ++j) p[j] = 0.0f;
          accumulate_e4m3x8(p, raw, scale);
        } else {
          unpack_bf16x8(ptx::ld_relaxed_gpu_v4(reinterpret_cast<const int4*>(row + idx * 2)), p);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[u][j] = __fadd_rn(acc[u][j], p[j]);
      }
    }
    auto* out = static_cast<__nv_bfloat16*>(a.out) + int64_t(t) * H;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t idx = int64_t(c) * kChunk + u * 256 + lane * 8;
      if (idx < H) *reinterpret_cast<int4*>(out + idx) = round_bf16x8(acc[u]);
    }
  }
  __syncthreads();
  ll_trace(a.trace, kLlTraceEnd);
}

template <int kPhases>
__global__ void __launch_bounds__(kLlThreads, 1)
    ll_combine_kernel(LlCombineArgs a, LlLayout l, LlPeers peers, WaitCtx ctx) {
  constexpr bool kSend = kPhases & (kLlSendPhase | kLlWeightsPhase), kRecv = kPhases & kLlRecvPhase;
  ll_gate(a.pdl);
  LlRanks alive;
  const uint64_t calls = ll_enter<kSend>(peers.at(ctx.rank), l, kLlCombine, a.slot, ctx, &alive);
  if constexpr (kPhases == kLlWeightsPhase) {
    // the weights alone, and the call's words with them; nothing advances the call numbers, so the send half that
    // follows uses the same sequence number (the same tags)
    store_weights(a, l, peers, ctx, alive);
    if (blockIdx.x == 0 && ll_inbox_agree_on(a.agree, l))
      ll_inbox_publish(peers, l, alive, kLlCombine, a.slot, ctx.rank, a.agree, ctx.seq);
  } else {
    ll_trace(a.trace, kLlTraceEntry);
    extern __shared__ int smem[];
    if (kSend) combine_send_phase(a, l, peers, ctx, alive, calls, smem);
    if (kRecv) combine_recv_phase(a, l, peers, ctx, alive, calls);
  }
}

}  // namespace

void launch_ll_combine(const LlCombineArgs& args, int phases, int num_blocks, const LlLayout& layout,
                       const LlPeers& peers, const WaitCtx& ctx, cudaStream_t stream) {
  DC_HOST_ASSERT(num_blocks >= 1 && num_blocks <= kMaxBlocks, "low_latency_combine: block count out of range");
  DC_HOST_ASSERT(args.topk <= layout.topk_max && args.num_tokens <= layout.max_tokens,
                 "low_latency_combine: tokens or topk over the buffer's maximum");
  const int smem = layout.num_ranks * int(sizeof(int));  // the send half's token count per source
  auto launch = [&](auto kernel, int bytes) {
    launch_kernel(kernel, num_blocks, kLlThreads, bytes, stream, args.pdl != 0, args, layout, peers, ctx);
  };
  switch (phases) {
    case kLlSendPhase: launch(ll_combine_kernel<kLlSendPhase>, smem); break;
    case kLlRecvPhase: launch(ll_combine_kernel<kLlRecvPhase>, 0); break;  // no shared memory
    case kLlBothPhases: launch(ll_combine_kernel<kLlBothPhases>, smem); break;
    // with peers reached by puts: the weights alone, put before the send half
    case kLlWeightsPhase: launch(ll_combine_kernel<kLlWeightsPhase>, 0); break;
    default:
      DC_HOST_ASSERT(false, "low_latency_combine: phases must be 1 (send), 2 (receive), 3 (both) or 4 (weights)");
  }
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
