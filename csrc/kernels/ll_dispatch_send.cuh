// The send half of the low-latency dispatch (ll_dispatch.cu has the kernel, the launcher and the overview):
// the rows of each row block's token range, the range's metadata, and block 0's counts. Included by ll_dispatch.cu
// only.
#pragma once
#include <cuda_bf16.h>

#include "api.hpp"
#include "bf16_vec.cuh"
#include "fp8_cast.cuh"
#include "ll_common.cuh"

namespace dc {

namespace {

constexpr int kShortRange = 64;                           // entries one warp ranks (a longer range: the block)
constexpr int kSendUnroll = 4;                            // 8-element vectors per lane per item
constexpr int kSendChunk = 32 * 8 * kSendUnroll;          // elements of a row one warp sends per item

// Element index of a lane's vector u (8 elements) in chunk c. BF16 rows: vectors interleave across the lanes, one
// 16-byte store each. FP8 rows: each lane holds 16 consecutive elements per pair of vectors, so its 16 e4m3 bytes
// leave as one 16-byte store (half the store instructions of 8 bytes per lane), and 8 lanes share a 128-block.
__device__ __forceinline__ int64_t send_elem(int c, int u, int lane, bool fp8) {
  return int64_t(c) * kSendChunk + (fp8 ? (u / 2) * 512 + lane * 16 + (u % 2) * 8 : u * 256 + lane * 8);
}

// One warp loads elements [c * kSendChunk, ...) of token t.
__device__ __forceinline__ void load_token_chunk(const LlDispatchArgs& a, const LlLayout& l, int t, int c, int lane,
                                                 int4 (&v)[kSendUnroll]) {
  const int64_t H = l.hidden;
  const auto* src = static_cast<const __nv_bfloat16*>(a.x) + int64_t(t) * H;
#pragma unroll
  for (int u = 0; u < kSendUnroll; ++u) {
    const int64_t idx = send_elem(c, u, lane, a.use_fp8);
    v[u] = idx < H ? ptx::ld_nc_na_v4(reinterpret_cast<const int4*>(src + idx)) : make_int4(0, 0, 0, 0);
  }
}

// One warp: the loaded chunk c of token t goes to every rank in `dests` (a destination list: ll_slot_rank).
__device__ __forceinline__ void send_token_chunk(const LlDispatchArgs& a, const LlLayout& l, const LlPeers& peers,
                                                 int rank, int t, int c, int dests, int lane,
                                                 const int4 (&v)[kSendUnroll]) {
  const int64_t H = l.hidden;
  if (!a.use_fp8) {
    LlDestWalk walk(dests);
    for (int d; (d = walk.next()) != kLlNoRank;) {
      uint8_t* row = peers.at(d) + l.stage_x_at(a.slot, rank, t);
#pragma unroll
      for (int u = 0; u < kSendUnroll; ++u) {
        const int64_t idx = send_elem(c, u, lane, false);
        if (idx < H) ptx::st_na_v4(reinterpret_cast<int4*>(row + idx * 2), v[u]);
      }
    }
    return;
  }
  constexpr int kPairs = kSendUnroll / 2;
  uint32_t q[kPairs][4];
  float scale[kPairs];
#pragma unroll
  for (int g = 0; g < kPairs; ++g) {
    float lo[8], hi[8], f[16];
    unpack_bf16x8(v[2 * g], lo);
    unpack_bf16x8(v[2 * g + 1], hi);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      f[j] = lo[j];
      f[8 + j] = hi[j];
    }
    quantize_e4m3<16>(f, a.use_ue8m0, &scale[g], q[g]);
  }
  LlDestWalk walk(dests);
  for (int d; (d = walk.next()) != kLlNoRank;) {
    uint8_t* row = peers.at(d) + l.stage_x_at(a.slot, rank, t);
    auto* scales = reinterpret_cast<float*>(peers.at(d) + l.stage_scales_at(a.slot, rank, t));
#pragma unroll
    for (int g = 0; g < kPairs; ++g) {
      const int64_t idx = send_elem(c, 2 * g, lane, true);  // 16-aligned; H % 128 == 0 keeps a block whole
      if (idx >= H) continue;
      ptx::st_na_v4(reinterpret_cast<int4*>(row + idx), make_int4(int(q[g][0]), int(q[g][1]), int(q[g][2]),
                                                                  int(q[g][3])));
      if ((lane & 7) == 0) scales[idx / 128] = scale[g];
    }
  }
}

// The expert an id names, -1 when empty, out of range, or on a masked rank.
__device__ __forceinline__ int valid_expert(const LlLayout& l, LlRanks alive, int64_t e) {
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

// Bad input in this call (which: 0 ids out of range, 1 a duplicate expert in a row): told to every live rank, us
// included, whose receive half records it (ll_record_bad_input), so every rank raises the same error once.
__device__ __forceinline__ void report_bad_input(const LlDispatchArgs& a, const LlLayout& l, const LlPeers& peers,
                                                 const WaitCtx& ctx, LlRanks alive, uint64_t calls, int which) {
  ll_store_to_live(peers, l, alive, l.input_err_at(a.slot, which, ctx.rank), calls);
}

// The rows of tokens [t0, t1): the block's warps take (token, chunk) items, item w first (already in `r`); each
// token goes once to every rank holding any of its experts.
__device__ __forceinline__ void send_rows(const LlDispatchArgs& a, const LlLayout& l, const LlPeers& peers, int rank,
                                          LlRanks alive, int t0, int t1, int nchunks, RowItem& r) {
  const int L = l.local_experts(), lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int item = warp; item < (t1 - t0) * nchunks; item += kLlWarps) {
    const int t = t0 + item / nchunks, c = item % nchunks;
    if (item != warp) load_row_item(a, l, t, c, r);
    send_token_chunk(a, l, peers, rank, t, c, ll_slot_rank(valid_expert(l, alive, r.id), L), lane, r.v);
  }
}

// Where a row block keeps the metadata of its tokens [t0, t1) (n = (t1 - t0) * K entries) in shared memory:
// 2 * n + E ints, and (kLlWarps + 1) * E more for a long range; the counts block needs E (send_smem_ints).
__host__ __device__ constexpr int send_smem_ints(int n, int E) {
  return 2 * n + (n > kShortRange ? kLlWarps + 2 : 1) * E;
}

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
// entries before t0 (a shared-memory histogram). A short range (n <= kShortRange) is then ranked by warp 0 alone
// (it starts its rows after that; the other warps start theirs at once); a long one after the rows, by
// send_range_meta.
__device__ __forceinline__ void rank_range_early(const LlDispatchArgs& a, const LlLayout& l, LlRanks alive, int t0,
                                                 int n, const RangeMeta& m) {
  const int E = l.num_experts, p0 = t0 * a.topk, tid = threadIdx.x;
  // a thread's first id of the range is in flight with the histogram's loads: one memory round trip for both
  const int64_t first = tid < n ? __ldg(a.topk_idx + p0 + tid) : -1;
  for (int e = tid; e < E; e += blockDim.x) m.before[e] = 0;
  __syncthreads();
  for_each_id(a.topk_idx, p0, [&](int64_t id) {
    const int e = valid_expert(l, alive, id);
    if (e >= 0) atomicAdd(m.before + e, 1);
  });
  if (tid < n) m.own[tid] = valid_expert(l, alive, first);
  for (int j = tid + blockDim.x; j < n; j += blockDim.x) m.own[j] = valid_expert(l, alive, __ldg(a.topk_idx + p0 + j));
  __syncthreads();
  if (n <= kShortRange && tid < 32)
    for (int base = 0; base < n; base += 32) ll_rank_chunk(m.own, base, n, m.before, m.rank_in);
}

// Second part, after the rows (whole block): a long range's block-wide ranking, then per-slot keys for every rank,
// our own keys (for recv_pos), and the duplicate check. Duplicate expert ids are reported and still dispatched as
// given, so an entry's rank can pass 16 bits only then: such an entry gets no key (the receiver likewise drops rows
// past an expert's R * M), and nothing is written out of bounds.
__device__ __forceinline__ void send_range_meta(const LlDispatchArgs& a, const LlLayout& l, const LlPeers& peers,
                                                const WaitCtx& ctx, LlRanks alive, uint64_t calls, int t0, int n,
                                                const RangeMeta& m) {
  const int R = l.num_ranks, E = l.num_experts, L = l.local_experts(), rank = ctx.rank;
  const int K = a.topk, tid = threadIdx.x;
  __syncthreads();  // warp 0's ranking of a short range is complete
  if (n > kShortRange) {
    ll_rank_entries(m.own, n, E, m.rank_in, m.counts, m.wcount);
    for (int j = tid; j < n; j += blockDim.x)
      if (m.own[j] >= 0) m.rank_in[j] += m.before[m.own[j]];
    __syncthreads();
  }
  ll_trace(a.trace, kLlTraceRanked);
  for (int i = tid; i < R * n; i += blockDim.x) {
    const int d = i / n, j = i % n, e = m.own[j];
    if (!ll_is_alive(alive, d)) continue;
    reinterpret_cast<int*>(peers.at(d) + l.meta_at(a.slot, rank, t0 + j / K))[j % K] =
        (e >= 0 && e / L == d && m.rank_in[j] <= 0xffff) ? ((e % L) << 16 | m.rank_in[j]) : -1;
  }
  int* keys = reinterpret_cast<int*>(peers.at(rank) + l.entry_key_at(a.slot)) + t0 * K;
  for (int j = tid; j < n; j += blockDim.x) {
    const int e = m.own[j];
    keys[j] = e >= 0 && m.rank_in[j] <= 0xffff ? (e << 16 | m.rank_in[j]) : -1;
    bool dup = false;
    for (int q = j - j % K; q < j; ++q) dup |= e >= 0 && m.own[q] == e;
    if (dup) report_bad_input(a, l, peers, ctx, alive, calls, 1);
  }
}

// The counts, by one block: our entries per expert to every rank (a shared-memory histogram of every id) and our
// token count, as words tagged with the call (ll_tagged: receivers poll them, so they need no fence), and the
// range check of the ids (out-of-range slots count as -1; the call still completes on every rank and the error is
// reported, not waited on). smem: E ints.
__device__ __forceinline__ void send_counts(const LlDispatchArgs& a, const LlLayout& l, const LlPeers& peers,
                                            const WaitCtx& ctx, LlRanks alive, uint64_t calls, int* smem) {
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
      ptx::st_relaxed_sys_u64(reinterpret_cast<uint64_t*>(peers.at(i / E) + l.counts_at(a.slot, rank)) + i % E,
                              ll_tagged(calls, counts[i % E]));
  if (tid < R && ll_is_alive(alive, tid))
    ptx::st_relaxed_sys_u64(reinterpret_cast<uint64_t*>(peers.at(tid) + l.ntok_at(a.slot, rank)),
                            ll_tagged(calls, T));
  if (tid == 0 && bad_id) report_bad_input(a, l, peers, ctx, alive, calls, 0);
}

// A row block's contiguous range of our tokens, [t0, t1) (empty for block 0 when there are several blocks), and
// the row chunks per token.
struct SendRange {
  int t0, t1, nchunks;
  __device__ SendRange(const LlDispatchArgs& a, const LlLayout& l) {
    const int T = a.num_tokens, G = gridDim.x;
    const int row_blocks = G > 1 ? G - 1 : 1, row_block = G > 1 ? int(blockIdx.x) - 1 : 0;
    const int per_block = (T + row_blocks - 1) / row_blocks;
    t0 = row_block >= 0 ? min(T, row_block * per_block) : T;
    t1 = min(T, t0 + per_block);
    nchunks = int((l.hidden + kSendChunk - 1) / kSendChunk);
  }
  // The warp's first (token, chunk) item, loaded at kernel entry: x and the ids owe nothing to the call numbers,
  // so their loads go out with ll_enter's.
  __device__ void load_first(const LlDispatchArgs& a, const LlLayout& l, RowItem& r) const {
    const int warp = threadIdx.x >> 5;
    if (warp < (t1 - t0) * nchunks) load_row_item(a, l, t0 + warp / nchunks, warp % nchunks, r);
  }
};

// Block 0 sends the counts; the other blocks each take a contiguous range of our tokens: they histogram the ids
// before it, send its rows (a short range is ranked meanwhile by one warp), then its metadata while the rows drain.
// Nothing on the way is ranked over all entries by one block, and every block signals its own arrival. A single
// block does all of it. r: the warp's first item (SendRange::load_first).
__device__ __forceinline__ void dispatch_send_phase(const LlDispatchArgs& a, const LlLayout& l, const LlPeers& peers,
                                                    const WaitCtx& ctx, LlRanks alive, uint64_t calls, int* smem,
                                                    const SendRange& range, RowItem& r) {
  const int t0 = range.t0, t1 = range.t1, nchunks = range.nchunks;
  // the call's words first, tagged like the counts, so a receiver compares them before it uses anything of ours
  if (blockIdx.x == 0 && ll_agree_on(a.agree, l))
    ll_agree_publish(peers, l, alive, kLlDispatch, a.slot, ctx.rank, a.agree, calls);
  if (blockIdx.x == 0 && ll_inbox_agree_on(a.agree, l))  // with put peers: inside the data the host puts
    ll_inbox_publish(peers, l, alive, kLlDispatch, a.slot, ctx.rank, a.agree, calls);
  if (t1 > t0) {  // the same for the whole block
    const int n = (t1 - t0) * a.topk;
    const RangeMeta m(smem, n, l.num_experts);
    rank_range_early(a, l, alive, t0, n, m);
    send_rows(a, l, peers, ctx.rank, alive, t0, t1, nchunks, r);
    ll_trace(a.trace, kLlTraceSendData);
    send_range_meta(a, l, peers, ctx, alive, calls, t0, n, m);
    __syncthreads();  // smem is reused below by a single block
  }
  if (blockIdx.x == 0) send_counts(a, l, peers, ctx, alive, calls, smem);
  ll_trace(a.trace, kLlTraceSendMeta);
  ll_finish_send(peers.at(ctx.rank), peers, l, kLlDispatch, a.slot, ctx.seq, calls, ctx.rank, alive, nullptr,
                 a.trace);
}

}  // namespace

}  // namespace dc
