// Low-latency dispatch over NVLink: one kernel with both halves when there is no hook, or the two halves as two
// launches so hook mode holds no SM between them:
//   send: each token goes once to every rank that holds any of its experts (cast to e4m3 once, inside the kernel,
//         when asked), into that rank's staging rows for us. Each row block takes a contiguous range of tokens
//         and also sends, per slot of its tokens, one int telling the receiver which of its experts the slot names
//         and the entry's rank there (ranked on top of a histogram of the entries before the range); block 0 sends
//         the per-expert counts. Nothing is waited for: no count exchange precedes the data, and each block's
//         arrival word covers its rows and metadata alike.
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

// f(id) for every id in ids[0, n), the block's threads in a strided loop with four loads in flight per thread
// (the loop body's shared-memory atomics would otherwise keep the next load from being issued early).
template <typename F>
__device__ __forceinline__ void for_each_id(const int64_t* ids, int n, F f) {
  for (int p = threadIdx.x; p < n; p += 4 * blockDim.x) {
    int64_t v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = p + u * int(blockDim.x) < n ? __ldg(ids + p + u * blockDim.x) : -1;
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (p + u * int(blockDim.x) < n) f(v[u]);
  }
}

// One warp's (token, chunk) item of the rows: the chunk of x and the token's ids (lane k < K: slot k).
struct RowItem {
  int4 v[kSendUnroll];
  int64_t id;
};

__device__ __forceinline__ void load_row_item(const LlDispatchArgs& a, const LlLayout& l, int t, int c, RowItem& r) {
  const int lane = threadIdx.x & 31;
  r.id = lane < a.topk ? __ldg(a.topk_idx + int64_t(t) * a.topk + lane) : -1;
  load_token_chunk(a, l, t, c, lane, r.v);
}

// The rows of tokens [t0, t1): the block's warps take (token, chunk) items, item w first (already in `r`); each
// token goes once to every rank holding any of its experts.
__device__ __forceinline__ void send_rows(const LlDispatchArgs& a, const LlLayout& l, const Peers& peers, int rank,
                                          uint32_t alive, int t0, int t1, int nchunks, RowItem& r) {
  const int L = l.local_experts(), lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int item = warp; item < (t1 - t0) * nchunks; item += kLlWarps) {
    const int t = t0 + item / nchunks, c = item % nchunks;
    if (item != warp) load_row_item(a, l, t, c, r);
    const uint32_t dests = ll_rank_mask(valid_expert(l, alive, r.id), L);
    if (dests) send_token_chunk(a, l, peers, rank, t, c, dests, lane, r.v);
  }
}

// Where a row block keeps the metadata of its tokens [t0, t1) (n = (t1 - t0) * K entries) in shared memory:
// 2 * n + (kLlWarps + 2) * E ints.
struct RangeMeta {
  int* own;      // [n] expert of each entry of the range, -1 for empty, invalid or masked slots
  int* rank_in;  // [n] rank of the entry among all ours of the same expert
  int* before;   // [E] our entries per expert before the range
  int* counts;   // [E] scratch of the block-wide ranking
  int* wcount;   // [kLlWarps][E] scratch of the block-wide ranking
  __device__ RangeMeta(int* smem, int n, int E)
      : own(smem), rank_in(smem + n), before(smem + 2 * n), counts(smem + 2 * n + E), wcount(smem + 2 * n + 2 * E) {}
};

// First part of a row block's metadata, before its rows: the range's ids, and the count of each expert among our
// entries before t0 (a shared-memory histogram). A short range (n <= 64) is then ranked by warp 0 alone (it
// starts its rows after that; the other warps start theirs at once); a long one after the rows, by ranked_late.
__device__ __forceinline__ void rank_range_early(const LlDispatchArgs& a, const LlLayout& l, uint32_t alive, int t0,
                                                 int n, const RangeMeta& m) {
  const int E = l.num_experts, p0 = t0 * a.topk, tid = threadIdx.x;
  for (int e = tid; e < E; e += blockDim.x) m.before[e] = 0;
  for (int j = tid; j < n; j += blockDim.x) m.own[j] = valid_expert(l, alive, __ldg(a.topk_idx + p0 + j));
  __syncthreads();
  for_each_id(a.topk_idx, p0, [&](int64_t id) {
    const int e = valid_expert(l, alive, id);
    if (e >= 0) atomicAdd(m.before + e, 1);
  });
  __syncthreads();
  if (n <= 64 && tid < 32)
    for (int base = 0; base < n; base += 32) ll_rank_chunk(m.own, base, n, m.before, m.rank_in);
}

// Second part, after the rows (whole block): a long range's block-wide ranking, then per-slot keys for every rank,
// our own keys (for recv_pos), and the duplicate check.
__device__ __forceinline__ void send_range_meta(const LlDispatchArgs& a, const LlLayout& l, const Peers& peers,
                                                const WaitCtx& ctx, uint32_t alive, int t0, int n, const RangeMeta& m) {
  const int R = l.num_ranks, E = l.num_experts, L = l.local_experts(), rank = ctx.rank;
  const int K = a.topk, tid = threadIdx.x;
  __syncthreads();  // warp 0's ranking of a short range is complete
  if (n > 64) {
    ll_rank_entries(m.own, n, E, m.rank_in, m.counts, m.wcount);
    for (int j = tid; j < n; j += blockDim.x)
      if (m.own[j] >= 0) m.rank_in[j] += m.before[m.own[j]];
    __syncthreads();
  }
  ll_trace(a.trace, kLlTraceRanked);
  for (int i = tid; i < R * n; i += blockDim.x) {
    const int d = i / n, j = i % n, e = m.own[j];
    if (!ll_is_alive(alive, d)) continue;
    reinterpret_cast<int*>(peers.base[d] + l.meta_at(a.slot, rank, t0 + j / K))[j % K] =
        (e >= 0 && e / L == d) ? ((e % L) << 16 | m.rank_in[j]) : -1;
  }
  int* keys = reinterpret_cast<int*>(peers.base[rank] + l.entry_key_at(a.slot)) + t0 * K;
  for (int j = tid; j < n; j += blockDim.x) {
    const int e = m.own[j];
    keys[j] = e >= 0 ? (e << 16 | m.rank_in[j]) : -1;
    bool dup = false;
    for (int q = j - j % K; q < j; ++q) dup |= e >= 0 && m.own[q] == e;
    if (dup) report_input_error(ctx, rank, kStageLlDuplicateIds);
  }
}

// The counts, by one block: our entries per expert to every rank (a shared-memory histogram of every id), our
// token count, and the range check of the ids (out-of-range slots count as -1; the call still completes on every
// rank and the error is reported, not waited on). smem: E ints.
__device__ __forceinline__ void send_counts(const LlDispatchArgs& a, const LlLayout& l, const Peers& peers,
                                            const WaitCtx& ctx, uint32_t alive, int* smem) {
  const int R = l.num_ranks, E = l.num_experts, rank = ctx.rank, T = a.num_tokens, P = T * a.topk;
  const int tid = threadIdx.x;
  int* counts = smem;  // [E]
  __shared__ int bad_id;
  if (tid == 0) bad_id = 0;
  for (int e = tid; e < E; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for_each_id(a.topk_idx, P, [&](int64_t id) {
    if (id < -1 || id >= E) bad_id = 1;
    const int e = valid_expert(l, alive, id);
    if (e >= 0) atomicAdd(counts + e, 1);
  });
  __syncthreads();
  ll_trace(a.trace, kLlTraceCounts);
  for (int i = tid; i < R * E; i += blockDim.x)
    if (ll_is_alive(alive, i / E))
      reinterpret_cast<int*>(peers.base[i / E] + l.counts_at(a.slot))[rank * E + i % E] = counts[i % E];
  if (tid < R && ll_is_alive(alive, tid)) reinterpret_cast<int*>(peers.base[tid] + l.ntok_at(a.slot))[rank] = T;
  if (tid == 0 && bad_id) report_input_error(ctx, rank, kStageLlInvalidIds);
}

// Block 0 sends the counts; the other blocks each take a contiguous range of our tokens: they histogram the ids
// before it, send its rows (a short range is ranked meanwhile by one warp), then its metadata while the rows drain.
// Nothing on the way is ranked over all entries by one block, and every block signals its own arrival. A single
// block does all of it.
__device__ __forceinline__ void dispatch_send_phase(const LlDispatchArgs& a, const LlLayout& l, const Peers& peers,
                                                    const WaitCtx& ctx, uint32_t alive, uint64_t calls, int* smem) {
  const int T = a.num_tokens, G = gridDim.x, warp = threadIdx.x >> 5;
  const int row_blocks = G > 1 ? G - 1 : 1, row_block = G > 1 ? int(blockIdx.x) - 1 : 0;
  const int per_block = (T + row_blocks - 1) / row_blocks;
  const int t0 = row_block >= 0 ? min(T, row_block * per_block) : T, t1 = min(T, t0 + per_block);
  if (t1 > t0) {  // the same for the whole block
    const int nchunks = int((l.hidden + kSendChunk - 1) / kSendChunk), n = (t1 - t0) * a.topk;
    RowItem r;
    if (warp < (t1 - t0) * nchunks) load_row_item(a, l, t0 + warp / nchunks, warp % nchunks, r);
    const RangeMeta m(smem, n, l.num_experts);
    rank_range_early(a, l, alive, t0, n, m);
    send_rows(a, l, peers, ctx.rank, alive, t0, t1, nchunks, r);
    ll_trace(a.trace, kLlTraceSendData);
    send_range_meta(a, l, peers, ctx, alive, t0, n, m);
    __syncthreads();  // smem is reused below by a single block
  }
  if (blockIdx.x == 0) send_counts(a, l, peers, ctx, alive, smem);
  ll_trace(a.trace, kLlTraceSendMeta);
  ll_finish_send(peers.base[ctx.rank], peers, l, kLlDispatch, a.slot, ctx.seq, calls, ctx.rank, alive, true, a.trace);
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

  // The output metadata, after the rows (nothing here is on the rows' path), from the last blocks first: the first
  // ones took the first rows.
  const int gtid = (gridDim.x - 1 - blockIdx.x) * blockDim.x + tid, gthreads = gridDim.x * blockDim.x;
  if (blockIdx.x == gridDim.x - 1) {
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
  if (kSend) dispatch_send_phase(a, l, peers, ctx, alive, calls, smem);
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
  // the send half's shared memory: a row block's range metadata (send_range_meta), or the counts (E ints)
  const int row_blocks = num_blocks > 1 ? num_blocks - 1 : 1;
  const int range_entries = (args.num_tokens + row_blocks - 1) / row_blocks * args.topk;
  const int send_smem = (2 * range_entries + (kLlWarps + 2) * layout.num_experts) * int(sizeof(int));
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
