// Low-latency dispatch over NVLink: one kernel with both halves when there is no hook, or the two halves as two
// launches so hook mode holds no SM between them:
//   send: each token goes once to every rank that holds any of its experts (cast to e4m3 once, inside the kernel,
//         when asked), into that rank's staging rows for us; meanwhile block 0 ranks our entries and sends, per
//         slot, one int telling the receiver which of its experts the slot names and the entry's rank there, plus
//         the counts. Nothing is waited for: no count exchange precedes the data, and one arrival word per rank
//         covers rows and metadata alike.
//   recv: waits for every rank's arrival word, then fans each staged token out to the packed rows of its local experts
//         (source ranks ascending, then the sender's entry order), records where each entry landed (for the
//         combine), and writes recv_count, layout, src_info and recv_pos as views the host hands out.
#include <cuda_bf16.h>

#include "../runtime/cuda_check.hpp"
#include "api.hpp"
#include "bf16_vec.cuh"
#include "fp8_cast.cuh"
#include "ll_common.cuh"

namespace dc {

namespace {

constexpr int kSendUnroll = 4;                            // 8-element vectors per lane per item
constexpr int kSendChunk = 32 * 8 * kSendUnroll;          // elements of a row one warp sends per item
constexpr int kCopyUnroll = 4;                            // 16-byte vectors per lane per item
constexpr int kCopyChunkBytes = 32 * 16 * kCopyUnroll;    // bytes of a staged row one warp fans out per item

// One warp loads elements [c * kSendChunk, ...) of token t.
__device__ __forceinline__ void load_token_chunk(const LlDispatchArgs& a, const LlLayout& l, int t, int c, int lane,
                                                 int4 (&v)[kSendUnroll]) {
  const int64_t H = l.hidden;
  const auto* src = static_cast<const __nv_bfloat16*>(a.x) + int64_t(t) * H;
#pragma unroll
  for (int u = 0; u < kSendUnroll; ++u) {
    const int64_t idx = int64_t(c) * kSendChunk + u * 256 + lane * 8;
    v[u] = idx < H ? ptx::ld_nc_na_v4(reinterpret_cast<const int4*>(src + idx)) : make_int4(0, 0, 0, 0);
  }
}

// One warp: the loaded chunk c of token t goes to every rank in `dests`.
__device__ __forceinline__ void send_token_chunk(const LlDispatchArgs& a, const LlLayout& l, const Peers& peers,
                                                 int rank, int t, int c, uint32_t dests, int lane,
                                                 const int4 (&v)[kSendUnroll]) {
  const int64_t H = l.hidden;
  if (!a.use_fp8) {
    for (uint32_t m = dests; m; m &= m - 1) {
      uint8_t* row = peers.base[__ffs(m) - 1] + l.stage_x_at(a.slot, rank, t);
#pragma unroll
      for (int u = 0; u < kSendUnroll; ++u) {
        const int64_t idx = int64_t(c) * kSendChunk + u * 256 + lane * 8;
        if (idx < H) ptx::st_na_v4(reinterpret_cast<int4*>(row + idx * 2), v[u]);
      }
    }
    return;
  }
  uint2 q[kSendUnroll];
  float scale[kSendUnroll];
#pragma unroll
  for (int u = 0; u < kSendUnroll; ++u) {
    float f[8];
    unpack_bf16x8(v[u], f);
    q[u] = quantize8_e4m3(f, a.use_ue8m0, &scale[u]);
  }
  for (uint32_t m = dests; m; m &= m - 1) {
    const int d = __ffs(m) - 1;
    uint8_t* row = peers.base[d] + l.stage_x_at(a.slot, rank, t);
    auto* scales = reinterpret_cast<float*>(peers.base[d] + l.stage_scales_at(a.slot, rank, t));
#pragma unroll
    for (int u = 0; u < kSendUnroll; ++u) {
      const int64_t idx = int64_t(c) * kSendChunk + u * 256 + lane * 8;
      if (idx >= H) continue;
      ptx::st_na_u64(reinterpret_cast<uint64_t*>(row + idx), (uint64_t(q[u].y) << 32) | q[u].x);
      if ((lane & 15) == 0) scales[idx / 128] = scale[u];
    }
  }
}

// The expert an id names, -1 when empty, out of range, or on a masked rank.
__device__ __forceinline__ int valid_expert(const LlLayout& l, uint32_t alive, int64_t e) {
  return (e >= 0 && e < l.num_experts && ll_is_alive(alive, int(e) / l.local_experts())) ? int(e) : -1;
}

// The rows: warps [first_warp, first_warp + num_warps) take (token, chunk) items; each token goes once to every
// rank holding any of its experts. The warp's first chunk is loaded together with its token's ids.
__device__ __forceinline__ void send_rows(const LlDispatchArgs& a, const LlLayout& l, const Peers& peers, int rank,
                                          uint32_t alive, int first_warp, int num_warps) {
  const int K = a.topk, T = a.num_tokens, L = l.local_experts(), lane = threadIdx.x & 31;
  const int nchunks = int((l.hidden + kSendChunk - 1) / kSendChunk);
  for (int item = first_warp; item < T * nchunks; item += num_warps) {
    const int t = item / nchunks, c = item % nchunks;
    const int64_t e = lane < K ? a.topk_idx[int64_t(t) * K + lane] : -1;
    int4 v[kSendUnroll];
    load_token_chunk(a, l, t, c, lane, v);
    const uint32_t dests = ll_rank_mask(valid_expert(l, alive, e), L);
    if (dests) send_token_chunk(a, l, peers, rank, t, c, dests, lane, v);
  }
}

// The metadata, by one block: every entry's rank among ours of its expert, then per-slot keys for every rank, our
// own keys (for recv_pos), the counts, the token count, and the input checks.
__device__ __forceinline__ void send_meta(const LlDispatchArgs& a, const LlLayout& l, const Peers& peers,
                                          const WaitCtx& ctx, uint32_t alive, int* smem) {
  const int R = l.num_ranks, E = l.num_experts, L = l.local_experts(), rank = ctx.rank;
  const int K = a.topk, T = a.num_tokens, P = T * K, tid = threadIdx.x;
  uint8_t* self = peers.base[rank];
  int* experts = smem;          // [P] expert of each entry, -1 for empty, invalid or masked slots
  int* rank_in = smem + P;      // [P] rank of the entry among ours of the same expert
  int* counts = smem + 2 * P;   // [E] our entries per expert
  int* wcount = counts + E;     // [kLlWarps][E] ranking scratch
  __shared__ int bad_id;
  if (tid == 0) bad_id = 0;
  __syncthreads();
  for (int i = tid; i < P; i += blockDim.x) {
    const int64_t e = a.topk_idx[i];
    if (e < -1 || e >= E) bad_id = 1;
    experts[i] = valid_expert(l, alive, e);
  }
  __syncthreads();
  ll_rank_entries(experts, P, E, rank_in, counts, wcount);
  for (int i = tid; i < R * P; i += blockDim.x) {
    const int d = i / P, p = i % P, e = experts[p];
    if (!ll_is_alive(alive, d)) continue;
    reinterpret_cast<int*>(peers.base[d] + l.meta_at(a.slot, rank, p / K))[p % K] =
        (e >= 0 && e / L == d) ? ((e % L) << 16 | rank_in[p]) : -1;
  }
  int* keys = reinterpret_cast<int*>(self + l.entry_key_at(a.slot));
  for (int p = tid; p < P; p += blockDim.x) keys[p] = experts[p] >= 0 ? (experts[p] << 16 | rank_in[p]) : -1;
  for (int i = tid; i < R * E; i += blockDim.x)
    if (ll_is_alive(alive, i / E))
      reinterpret_cast<int*>(peers.base[i / E] + l.counts_at(a.slot))[rank * E + i % E] = counts[i % E];
  if (tid < R && ll_is_alive(alive, tid)) reinterpret_cast<int*>(peers.base[tid] + l.ntok_at(a.slot))[rank] = T;
  // Input problems are reported, not waited on: the call still completes on every rank (bad slots count as -1).
  // A duplicate is reported only without bad ids.
  if (tid == 0 && bad_id) report_input_error(ctx, rank, kStageLlInvalidIds);
  for (int t = tid; t < T && !bad_id; t += blockDim.x) {
    bool dup = false;
    for (int k = 1; k < K; ++k)
      for (int j = 0; j < k; ++j) dup |= experts[t * K + k] >= 0 && experts[t * K + k] == experts[t * K + j];
    if (dup) report_input_error(ctx, rank, kStageLlDuplicateIds);
  }
}

// Two roles run at once: block 0 computes and stores the metadata while the other blocks send the rows (with a
// single block, it does both, rows first). Ranking is then off the rows' path, and the arrival signal waits only
// for the slower of the two.
__device__ __forceinline__ void dispatch_send_phase(const LlDispatchArgs& a, const LlLayout& l, const Peers& peers,
                                                    const WaitCtx& ctx, uint32_t alive, int* smem) {
  const int warp = threadIdx.x >> 5;
  const bool meta_block = blockIdx.x == 0, rows_too = gridDim.x == 1;
  if (!meta_block || rows_too) {
    const int row_block = rows_too ? 0 : blockIdx.x - 1, row_blocks = rows_too ? 1 : gridDim.x - 1;
    send_rows(a, l, peers, ctx.rank, alive, row_block * kLlWarps + warp, row_blocks * kLlWarps);
    ll_trace(a.trace, kLlTraceSendData);
  }
  if (meta_block) {
    send_meta(a, l, peers, ctx, alive, smem);
    ll_trace(a.trace, kLlTraceSendMeta);
  }
  ll_finish_send(peers.base[ctx.rank], peers, l, kLlDispatch, a.slot, ctx.seq, ctx.rank, alive, true, a.trace);
}

// calls: the slot's send count this receive waits for (every rank's).
__device__ __forceinline__ void dispatch_recv_phase(const LlDispatchArgs& a, const LlLayout& l, const Peers& peers,
                                                    const WaitCtx& ctx, uint32_t alive, uint64_t calls, int* smem) {
  const int R = l.num_ranks, L = l.local_experts(), rank = ctx.rank, slot = a.slot;
  const int K = a.topk, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool use_fp8 = a.use_fp8;
  const int64_t rows = l.rows_per_expert();
  uint8_t* self = peers.base[rank];
  int* base = smem;               // [L][R]
  int* total = smem + L * R;      // [L]
  int* n = total + L;             // [R] tokens of each source
  __shared__ int ok, items;
  if (!ll_wait_arrivals(self, l, kLlDispatch, slot, calls, alive, ctx, kStageLlDispatchData, &ok)) return;
  ll_trace(a.trace, kLlTraceArrived);
  const int* counts = reinterpret_cast<const int*>(self + l.counts_at(slot));
  const int* ntok = reinterpret_cast<const int*>(self + l.ntok_at(slot));
  if (tid < R) n[tid] = ll_is_alive(alive, tid) ? ptx::ld_volatile_s32(ntok + tid) : 0;
  ll_expert_bases(counts, l, rank, alive, base, total);  // starts and ends with __syncthreads

  // Fan-out: warps take (source rank, token, chunk) items and copy the staged row to each of its entries here.
  // The row's loads go out with its keys (a token not sent here is loaded for nothing: cheaper than waiting).
  const int64_t x_bytes = use_fp8 ? l.hidden : l.hidden * 2, spr = l.scales_per_row(), n16 = x_bytes / 16;
  const int nchunks = int((x_bytes + kCopyChunkBytes - 1) / kCopyChunkBytes);
  if (tid == 0) {
    int sum = 0;
    for (int s = 0; s < R; ++s) sum += n[s];
    items = sum * nchunks;
  }
  __syncthreads();
  ll_trace(a.trace, kLlTraceRecvMeta);
  uint8_t* recv_x = self + l.recv_x_at(slot);
  auto* recv_scales = reinterpret_cast<float*>(self + l.recv_scales_at(slot));
  int* src_info = reinterpret_cast<int*>(self + l.out_src_info_at(slot));
  const int total_warps = gridDim.x * kLlWarps;
  for (int item = blockIdx.x * kLlWarps + warp; item < items; item += total_warps) {
    int s, rest;
    ll_item_source(n, R, nchunks, item, &s, &rest);
    const int t = rest / nchunks, c = rest % nchunks;
    const int key = lane < K ? ptx::ld_volatile_s32(reinterpret_cast<const int*>(self + l.meta_at(slot, s, t)) + lane) : -1;
    const auto* src = reinterpret_cast<const int4*>(self + l.stage_x_at(slot, s, t));
    int4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const int64_t i = int64_t(c) * (kCopyChunkBytes / 16) + u * 32 + lane;
      if (i < n16) v[u] = ptx::ld_relaxed_gpu_v4(src + i);
    }
    const int64_t entry = key >= 0 ? (key >> 16) * rows + base[(key >> 16) * R + s] + (key & 0xffff) : -1;
    if (c == 0 && lane < K)  // for the combine
      reinterpret_cast<int*>(self + l.entry_at(slot, s, t))[lane] = int(entry);
    const uint32_t mine = __ballot_sync(0xffffffffu, key >= 0);
    if (!mine) continue;
    for (uint32_t m = mine; m; m &= m - 1) {
      const int64_t e = __shfl_sync(0xffffffffu, entry, __ffs(m) - 1);
      auto* dst = reinterpret_cast<int4*>(recv_x + e * x_bytes);
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        const int64_t i = int64_t(c) * (kCopyChunkBytes / 16) + u * 32 + lane;
        if (i < n16) ptx::st_na_v4(dst + i, v[u]);
      }
    }
    if (c != 0) continue;
    if (key >= 0) src_info[entry] = t;
    if (use_fp8) {
      // each scale is loaded once, then stored to every entry
      const auto* sc = reinterpret_cast<const uint32_t*>(self + l.stage_scales_at(slot, s, t));
      for (int j0 = 0; j0 < spr; j0 += 32) {
        const int j = j0 + lane;
        const float v = j < spr ? __uint_as_float(ptx::ld_relaxed_gpu_u32(sc + j)) : 0.0f;
        for (uint32_t m = mine; m; m &= m - 1) {
          const int64_t e = __shfl_sync(0xffffffffu, entry, __ffs(m) - 1);
          if (j < spr) recv_scales[e * spr + j] = v;
        }
      }
    }
  }

  // The output metadata, after the rows (nothing here is on the rows' path).
  const int gtid = blockIdx.x * blockDim.x + tid, gthreads = gridDim.x * blockDim.x;
  if (blockIdx.x == 0) {
    int* out_count = reinterpret_cast<int*>(self + l.out_count_at(slot));
    int* out_layout = reinterpret_cast<int*>(self + l.out_layout_at(slot));
    for (int i = tid; i < L * R; i += blockDim.x) {
      const int le = i / R, s = i % R;
      out_layout[2 * i] = base[i];
      out_layout[2 * i + 1] = ll_count(counts, l, alive, s, rank * L + le);
      if (s == 0) out_count[le] = total[le];
    }
  }
  for (int i = gtid; i < L * int(rows); i += gthreads)  // L * R * M < 2^31 (asserted at launch)
    if (i % int(rows) >= total[i / int(rows)]) src_info[i] = -1;
  // recv_pos of our own entries: rows of lower ranks at the owner, plus the entry's rank among ours.
  const int* keys = reinterpret_cast<const int*>(self + l.entry_key_at(slot));
  int* recv_pos = reinterpret_cast<int*>(self + l.out_recv_pos_at(slot));
  const int P = n[rank] * K;
  for (int p = gtid; p < P; p += gthreads) {
    const int key = keys[p];
    int pos = -1;
    if (key >= 0) {
      pos = key & 0xffff;
      for (int s = 0; s < rank; ++s) pos += ll_count(counts, l, alive, s, key >> 16);
    }
    recv_pos[p] = pos;
  }
  __syncthreads();
  ll_trace(a.trace, kLlTraceEnd);
}

template <int kPhases>
__global__ void __launch_bounds__(kLlThreads, 1)
    ll_dispatch_kernel(LlDispatchArgs a, LlLayout l, Peers peers, WaitCtx ctx) {
  constexpr bool kSend = kPhases & kLlSendPhase, kRecv = kPhases & kLlRecvPhase;
  uint32_t alive;
  const uint64_t calls = ll_enter<kSend>(peers.base[ctx.rank], l, kLlDispatch, a.slot, ctx, &alive);
  ll_trace(a.trace, kLlTraceEntry);
  extern __shared__ int smem[];
  if (kSend) dispatch_send_phase(a, l, peers, ctx, alive, smem);
  if (kRecv) dispatch_recv_phase(a, l, peers, ctx, alive, calls, smem);  // smem reused: the send half is done
}

template <int kPhases>
void launch_phases(const LlDispatchArgs& args, int num_blocks, int smem, const LlLayout& layout, const Peers& peers,
                   const WaitCtx& ctx, cudaStream_t stream) {
  if (smem > 48 * 1024)
    DC_CUDA_CHECK(cudaFuncSetAttribute(ll_dispatch_kernel<kPhases>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  ll_dispatch_kernel<kPhases><<<num_blocks, kLlThreads, smem, stream>>>(args, layout, peers, ctx);
}

}  // namespace

void launch_ll_dispatch(const LlDispatchArgs& args, int phases, int num_blocks, const LlLayout& layout,
                        const Peers& peers, const WaitCtx& ctx, cudaStream_t stream) {
  DC_HOST_ASSERT(num_blocks >= 1 && num_blocks <= kMaxBlocks, "low_latency_dispatch: block count out of range");
  DC_HOST_ASSERT(args.num_tokens <= layout.max_tokens && args.topk <= layout.topk_max,
                 "low_latency_dispatch: tokens or topk over the buffer's maximum");
  DC_HOST_ASSERT(layout.hidden % 128 == 0, "low_latency_dispatch: hidden must be a multiple of 128");
  DC_HOST_ASSERT(layout.max_tokens <= 0xffff && layout.num_experts <= 0x7fff,
                 "low_latency_dispatch: entry keys pack 16-bit ranks and 15-bit experts");
  DC_HOST_ASSERT(int64_t(layout.local_experts()) * layout.rows_per_expert() < (int64_t(1) << 31),
                 "low_latency_dispatch: local experts * ranks * max tokens must stay below 2^31");
  const int send_smem = (2 * args.num_tokens * args.topk + (1 + kLlWarps) * layout.num_experts) * int(sizeof(int));
  const int recv_smem = (layout.local_experts() * (layout.num_ranks + 1) + layout.num_ranks) * int(sizeof(int));
  DC_HOST_ASSERT(send_smem <= 200 * 1024,
                 "low_latency_dispatch: tokens * topk too large for one block's shared memory");
  DC_HOST_ASSERT(recv_smem <= 48 * 1024, "low_latency_dispatch: too many local experts");
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
