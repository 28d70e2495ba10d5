// Normal-mode combine over NVLink. Two roles per block:
//   senders  (the first kSend warps): chunks of kCombineChunk received rows; every row whose source is another
//            rank is stored into that rank's staging slot [our rank][token]; after the chunk, one system fence
//            and one flag per remote source in it;
//   reducers (the other warps): for each of our tokens, wait for the chunk flags of the ranks that hold it,
//            then sum the rows ranks ascending in fp32 (our own row read straight from x), round once to bf16.
// Senders first wait for the destination's combine_ready flag, raised at the start of its kernel, so a
// back-to-back combine never overwrites staging rows the destination is still reading.
// kBulk (BF16 only): the reducers load the rows they sum by bulk copies into shared memory (combine_bulk_reduce.cuh).
// kFp8 (CombineArgs::use_fp8): remote rows travel as e4m3 + per-128 fp32 scales (combine_fp8.cuh); rows of our own
// tokens never leave the GPU and are summed from x as bf16 either way.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "../runtime/call_entry.cuh"
#include "../runtime/cuda_check.hpp"
#include "../runtime/smem_opt_in.hpp"
#include "../runtime/tuning.hpp"
#include "../runtime/wait.cuh"
#include "agree.cuh"
#include "api.hpp"
#include "bf16_vec.cuh"
#include "combine_bulk_reduce.cuh"
#include "combine_fp8.cuh"
#include "combine_weights.cuh"
#include "warp_copy.cuh"

namespace dc {

namespace {

// Staging row layout of one call: row stride and where the K fp32 weights start in a row.
template <bool kFp8>
__device__ __forceinline__ int64_t stage_row_bytes(const CombineArgs& a) {
  return kFp8 ? combine_fp8_row_bytes(a.hidden, a.topk) : combine_row_bytes(a.hidden, a.topk);
}
template <bool kFp8>
__device__ __forceinline__ int64_t stage_weights_offset(const CombineArgs& a) {
  return kFp8 ? int64_t(a.hidden) + a.hidden / 128 * 4 : int64_t(a.hidden) * 2;
}

// Source rank of received row i, given each source's first row (sources are contiguous, ascending).
__device__ __forceinline__ int source_of_row(int i, const int* recv_base, int num_ranks) {
  int s = 0;
#pragma unroll
  for (int q = 1; q < kMaxRanks; ++q) s += (q < num_ranks && recv_base[q] <= i) ? 1 : 0;
  return s;
}

template <int kSend, int kUnroll, bool kFp8>
__device__ __forceinline__ void send_rows(const CombineArgs& a, const NvlLayout& layout, const Peers& peers,
                                          const WaitCtx& ctx, const int* recv_base, int warp, int lane) {
  const int R = layout.num_ranks, rank = ctx.rank;
  const int64_t row_bytes = stage_row_bytes<kFp8>(a), w_off = stage_weights_offset<kFp8>(a);
  const int64_t n16 = int64_t(a.hidden) / 8, max_chunks = combine_max_chunks(R, layout.max_tokens);
  const int num_chunks = (a.num_recv + kCombineChunk - 1) / kCombineChunk;
  for (int c = blockIdx.x * kSend + warp; c < num_chunks; c += gridDim.x * kSend) {
    const int first = c * kCombineChunk, count = min(kCombineChunk, a.num_recv - first);
    // Lane j < count learns row first+j's source and token up front, so the copies below start at once.
    const int my_src = lane < count ? source_of_row(first + lane, recv_base, R) : rank;
    const int my_tok = lane < count ? a.recv_src_idx[first + lane] : 0;
    uint32_t sources = 0;
    for (int j = 0; j < count; ++j) {
      const int s = __shfl_sync(0xffffffffu, my_src, j), t = __shfl_sync(0xffffffffu, my_tok, j);
      if (s == rank) continue;  // our own tokens are reduced straight from x
      sources |= 1u << s;
      const int i = first + j;
      uint8_t* slot = peers.base[s] + layout.combine_stage + (int64_t(rank) * layout.max_tokens + t) * row_bytes;
      const int4* src = reinterpret_cast<const int4*>(static_cast<const uint8_t*>(a.x) + int64_t(i) * a.hidden * 2);
      if constexpr (kFp8)
        warp_store_row_e4m3<kUnroll>(src, slot, n16, lane);
      else
        warp_copy_v4<kUnroll>(src, reinterpret_cast<int4*>(slot), n16, lane);
      if (a.topk_weights != nullptr && lane < a.topk)
        reinterpret_cast<float*>(slot + w_off)[lane] = a.topk_weights[int64_t(i) * a.topk + lane];
    }
    __syncwarp();
    if (lane == 0 && sources != 0) {
      ptx::fence_acq_rel_sys();
      for (int s = 0; s < R; ++s)
        if ((sources >> s) & 1u) {
          auto* flag = reinterpret_cast<uint64_t*>(peers.base[s] + layout.combine_flag);
          ptx::st_relaxed_sys_u64(flag + int64_t(rank) * max_chunks + c, ctx.seq);
        }
    }
  }
}

// The pipelined reducer (kPipe): a token's row is summed in steps, pass-major and source ranks ascending within a
// pass (the plain loop's order), and the vectors of the next step are loaded before the current step is added, so
// a lane keeps two steps (2 x kUnroll vectors) in flight where the plain loop keeps one. An e4m3 source's step
// holds its 8 bytes in .x/.y and the fp32 scale's bits in .z of each int4.
template <int kUnroll, bool kFp8>
__device__ __forceinline__ void load_step(int4 (&v)[kUnroll], const uint8_t* row, bool own, int64_t base,
                                          int64_t n16) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = base + u * 32;
    if (i >= n16) continue;
    if (own) {
      v[u] = ptx::ld_nc_na_v4(reinterpret_cast<const int4*>(row) + i);
    } else if constexpr (kFp8) {
      const uint2 q = ptx::ld_relaxed_gpu_v2(reinterpret_cast<const uint2*>(row) + i);
      const uint32_t scale = ptx::ld_relaxed_gpu_u32(reinterpret_cast<const uint32_t*>(row + n16 * 8) + i / 16);
      v[u] = make_int4(int(q.x), int(q.y), int(scale), 0);
    } else {
      v[u] = ptx::ld_relaxed_gpu_v4(reinterpret_cast<const int4*>(row) + i);
    }
  }
}

template <int kUnroll, bool kFp8>
__device__ __forceinline__ void add_step(float (&acc)[kUnroll][8], const int4 (&v)[kUnroll], bool own, int64_t base,
                                         int64_t n16) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (base + u * 32 >= n16) continue;
    if (kFp8 && !own)
      accumulate_e4m3x8(acc[u], make_uint2(uint32_t(v[u].x), uint32_t(v[u].y)), __uint_as_float(uint32_t(v[u].z)));
    else
      accumulate_bf16x8(acc[u], v[u]);
  }
}

// Ends a pass when source s is its last holder: the sums rounded into `out`, and zeroed for the next pass.
template <int kUnroll>
__device__ __forceinline__ void end_pass_after(float (&acc)[kUnroll][8], int s, uint32_t holders, int4* out,
                                               int64_t base, int64_t n16) {
  if ((holders >> s) > 1u) return;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (base + u * 32 < n16) out[base + u * 32] = round_bf16x8(acc[u]);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[u][j] = 0.0f;
  }
}

template <int kUnroll, bool kFp8>
__device__ __forceinline__ void reduce_row_pipelined(uint32_t holders, int rank, const uint8_t* own_row,
                                                     const uint8_t* stage_rows, int64_t stage_stride, int4* out,
                                                     int64_t n16, int lane) {
  float acc[kUnroll][8];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[u][j] = 0.0f;
  if (holders == 0u) {  // no rank holds the token: zeros, as the plain loop writes
    for (int64_t base = lane; base < n16; base += 32 * kUnroll)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (base + u * 32 < n16) out[base + u * 32] = round_bf16x8(acc[u]);
    return;
  }
  const int first = __ffs(holders) - 1;
  const auto row_of = [&](int s) { return s == rank ? own_row : stage_rows + s * stage_stride; };
  // the step after (s, base): the next holder above s in the same pass, else the first holder of the next pass
  const auto advance = [&](int& s, int64_t& base) {
    const uint32_t above = holders & ~((2u << s) - 1u);
    if (above != 0u) {
      s = __ffs(above) - 1;
    } else {
      s = first;
      base += 32 * kUnroll;
    }
  };
  int4 va[kUnroll], vb[kUnroll];
  int sa = first, sb = first;
  int64_t ba = lane, bb = lane;
  load_step<kUnroll, kFp8>(va, row_of(sa), sa == rank, ba, n16);
  while (true) {
    sb = sa;
    bb = ba;
    advance(sb, bb);
    if (bb < n16) load_step<kUnroll, kFp8>(vb, row_of(sb), sb == rank, bb, n16);
    add_step<kUnroll, kFp8>(acc, va, sa == rank, ba, n16);
    end_pass_after<kUnroll>(acc, sa, holders, out, ba, n16);
    if (bb >= n16) break;
    sa = sb;
    ba = bb;
    advance(sa, ba);
    if (ba < n16) load_step<kUnroll, kFp8>(va, row_of(sa), sa == rank, ba, n16);
    add_step<kUnroll, kFp8>(acc, vb, sb == rank, bb, n16);
    end_pass_after<kUnroll>(acc, sb, holders, out, bb, n16);
    if (ba >= n16) break;
  }
}

// A token's row summed straight from global memory, kUnroll vectors per lane in flight: the holders' rows ranks
// ascending (our own from own_row, a peer's from its staging row), rounded once into out.
template <int kUnroll, bool kFp8>
__device__ __forceinline__ void reduce_row_plain(uint32_t holders, int R, int rank, const uint8_t* own_row,
                                                 const uint8_t* stage_rows, int64_t stage_stride, int4* out,
                                                 int64_t n16, int lane) {
  for (int64_t base = lane; base < n16; base += 32 * kUnroll) {
    float acc[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[u][j] = 0.0f;
    for (int s = 0; s < R; ++s) {
      if (!((holders >> s) & 1u)) continue;
      if (kFp8 && s != rank) {
        // e4m3 row: 8 bytes per 16-byte bf16 vector, the scale of its 128-element block after the values
        const uint8_t* row = stage_rows + s * stage_stride;
        const auto* q8 = reinterpret_cast<const uint2*>(row);
        const auto* sc = reinterpret_cast<const uint32_t*>(row + n16 * 8);
        uint2 q[kUnroll];
        float scale[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (base + u * 32 < n16) {
            q[u] = ptx::ld_relaxed_gpu_v2(q8 + base + u * 32);
            scale[u] = __uint_as_float(ptx::ld_relaxed_gpu_u32(sc + (base + u * 32) / 16));
          }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (base + u * 32 < n16) accumulate_e4m3x8(acc[u], q[u], scale[u]);
        continue;
      }
      const int4* src = s == rank ? reinterpret_cast<const int4*>(own_row)
                                  : reinterpret_cast<const int4*>(stage_rows + s * stage_stride);
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (base + u * 32 < n16)
          v[u] = s == rank ? ptx::ld_nc_na_v4(src + base + u * 32) : ptx::ld_relaxed_gpu_v4(src + base + u * 32);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (base + u * 32 < n16) accumulate_bf16x8(acc[u], v[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * 32 < n16) out[base + u * 32] = round_bf16x8(acc[u]);
  }
}

template <int kReduce, int kUnroll, bool kFp8, bool kPipe>
__device__ __forceinline__ void reduce_tokens(const CombineArgs& a, const NvlLayout& layout, const Peers& peers,
                                              const WaitCtx& ctx, int self_base, int warp, int lane) {
  const int R = layout.num_ranks, rank = ctx.rank;
  uint8_t* self = peers.base[rank];
  const int64_t row_bytes = stage_row_bytes<kFp8>(a), w_off = stage_weights_offset<kFp8>(a);
  const int64_t n16 = int64_t(a.hidden) / 8;
  const auto* flags = reinterpret_cast<const uint64_t*>(self + layout.combine_flag);
  const int64_t max_chunks = combine_max_chunks(R, layout.max_tokens);
  // Lane s: first row of our tokens among rank s's received rows.
  int my_base_at = 0;
  for (int q = 0; q < rank; ++q) my_base_at += lane < R ? a.count_matrix[q * R + lane] : 0;
  const int total = gridDim.x * kReduce;
  int t = blockIdx.x * kReduce + warp;
  int next_pos = (t < a.num_tokens && lane < R) ? a.send_pos[int64_t(t) * R + lane] : -1;
  for (; t < a.num_tokens; t += total) {
    const int my_pos = next_pos;
    if (t + total < a.num_tokens && lane < R) next_pos = a.send_pos[int64_t(t + total) * R + lane];  // prefetch
    const uint32_t holders = __ballot_sync(0xffffffffu, my_pos >= 0);
    const int self_pos = __shfl_sync(0xffffffffu, my_pos, rank);
    // Wait for the chunk holding this token's row at every other holder; lane s waits for rank s.
    bool ok = true;
    if (lane < R && lane != rank && my_pos >= 0) {
      const int chunk = (my_base_at + my_pos) / kCombineChunk;
      ok = wait_flag_geq(flags + lane * max_chunks + chunk, ctx.seq, ctx, lane, kStageCombineToken);
    }
    if (!__all_sync(0xffffffffu, ok)) return;

    const uint8_t* own_row = static_cast<const uint8_t*>(a.x) + int64_t(self_base + self_pos) * a.hidden * 2;
    const uint8_t* stage_rows = self + layout.combine_stage + int64_t(t) * row_bytes;
    const int64_t stage_stride = int64_t(layout.max_tokens) * row_bytes;  // between source ranks
    int4* out = reinterpret_cast<int4*>(static_cast<uint8_t*>(a.out) + int64_t(t) * a.hidden * 2);
    if constexpr (kPipe)
      reduce_row_pipelined<kUnroll, kFp8>(holders, rank, own_row, stage_rows, stage_stride, out, n16, lane);
    if constexpr (!kPipe)
      reduce_row_plain<kUnroll, kFp8>(holders, R, rank, own_row, stage_rows, stage_stride, out, n16, lane);
    reduce_token_weights(a, t, holders, R, rank, self_base + self_pos, stage_rows, stage_stride, w_off, lane);
  }
}

template <int kSend, int kReduce, int kUnroll, bool kFp8, bool kPipe, bool kBulk = false>
__global__ void __launch_bounds__((kSend + kReduce) * 32, 1)
    combine_kernel(CombineArgs a, NvlLayout layout, Peers peers, WaitCtx ctx_in) {
  uint8_t* self = peers.base[ctx_in.rank];
  const WaitCtx ctx =
      enter_call(ctx_in, reinterpret_cast<uint32_t*>(self + layout.notify_work + NotifyWork::kEntryTicket));
  const int R = layout.num_ranks, rank = ctx.rank, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  __shared__ int recv_base[kMaxRanks];  // first row from each source rank in our received rows
  __shared__ int ready_ok;
  if (tid == 0) {
    int acc = 0;
    for (int s = 0; s < R; ++s) {
      recv_base[s] = acc;
      acc += a.count_matrix[s * R + rank];
    }
    ready_ok = 1;
  }
  // x may be a worst-case-sized buffer: only the rows that really arrived go back.
  int real = 0;
  for (int s = 0; s < R; ++s) real += a.count_matrix[s * R + rank];
  a.num_recv = min(a.num_recv, real);
  const bool agree = agree_on(a.agree);
  if (blockIdx.x == 0 && tid < R) {  // the call's words go with combine_ready, one fence releasing both
    uint64_t* words_tag =
        agree ? agree_store_words(peers.base[tid] + layout.agree_at(ctx.seq) + int64_t(rank) * kAgreeSlotBytes, a.agree)
              : nullptr;
    release_words_and_flag(words_tag, reinterpret_cast<uint64_t*>(peers.base[tid] + layout.combine_ready) + rank,
                           ctx.seq);
  }
  __syncthreads();
  // Senders and reducers alike compare every rank's words first: on a difference (or a rank that rejected its
  // call) no rank sends or sums a row, so none waits for rows that never come.
  if (agree && agree_block(self + layout.agree_at(ctx.seq), a.agree, ctx.seq, R, AllRanks{}, ctx, kStageAgree,
                           true).status != 1)
    return;

  if (warp < kSend) {
    if (tid < R) {
      const auto* ready = reinterpret_cast<const uint64_t*>(self + layout.combine_ready) + tid;
      if (!wait_flag_geq(ready, ctx.seq, ctx, tid, kStageCombineReady)) ready_ok = 0;
    }
    ptx::named_barrier_sync(1, kSend * 32);
    if (!ready_ok) return;
    send_rows<kSend, kUnroll, kFp8>(a, layout, peers, ctx, recv_base, warp, lane);
  } else if constexpr (kBulk) {
    static_assert(!kFp8, "bulk reducers sum BF16 rows");
    extern __shared__ __align__(128) uint8_t reduce_rings[];
    __shared__ uint64_t reduce_bars[kReduce][kRowSlotsMax];
    const int w = warp - kSend;
    const int64_t stage_row = combine_row_bytes(a.hidden, a.topk);
    const int64_t stage_stride = int64_t(layout.max_tokens) * stage_row, n16 = int64_t(a.hidden) / 8;
    const int self_base = recv_base[rank];
    const auto sum_direct = [&](uint32_t holders, int self_pos, int t, int4* out) {
      const uint8_t* own_row = static_cast<const uint8_t*>(a.x) + int64_t(self_base + self_pos) * a.hidden * 2;
      const uint8_t* stage_rows = self + layout.combine_stage + int64_t(t) * stage_row;
      reduce_row_plain<kUnroll, false>(holders, R, rank, own_row, stage_rows, stage_stride, out, n16, lane);
    };
    reduce_tokens_bulk<kReduce>(a, layout, peers, ctx, self_base, w, lane, reduce_rings, reduce_bars[w], sum_direct);
  } else {
    reduce_tokens<kReduce, kUnroll, kFp8, kPipe>(a, layout, peers, ctx, recv_base[rank], warp - kSend, lane);
  }
}

template <int kSend, int kReduce, int kUnroll, bool kPipe = false>
void launch_combine_as(const CombineArgs& a, int num_blocks, const NvlLayout& layout, const Peers& peers,
                       const WaitCtx& ctx, cudaStream_t stream) {
  constexpr int kThreads = (kSend + kReduce) * 32;
  if (a.use_fp8)
    combine_kernel<kSend, kReduce, kUnroll, true, kPipe><<<num_blocks, kThreads, 0, stream>>>(a, layout, peers, ctx);
  else
    combine_kernel<kSend, kReduce, kUnroll, false, kPipe><<<num_blocks, kThreads, 0, stream>>>(a, layout, peers, ctx);
}

// The bulk reducers (combine_bulk_reduce.cuh), with as many row slots per reducer warp as the shared memory holds.
// False: not even one row slot per warp fits (a large hidden), nothing launched.
template <int kSend, int kReduce, int kUnroll>
bool launch_combine_bulk(const CombineArgs& a, int num_blocks, const NvlLayout& layout, const Peers& peers,
                         const WaitCtx& ctx, cudaStream_t stream) {
  constexpr auto kKernel = combine_kernel<kSend, kReduce, kUnroll, false, false, true>;
  const int64_t row = int64_t(a.hidden) * 2;
  const int slots = reduce_row_slots(row, kReduce, dynamic_smem_room<kKernel>());
  if (slots < 1) return false;
  const int smem = int(kReduce * slots * row);
  opt_in_dynamic_smem<kKernel>(smem);
  kKernel<<<num_blocks, (kSend + kReduce) * 32, smem, stream>>>(a, layout, peers, ctx);
  return true;
}

}  // namespace

// Warp split (senders, reducers) and unroll. Measured on 2 x H200 at 4096 tokens, hidden 7168, 24 SMs:
// <8,8,8> 367 us, <16,16,2> 462 us, <12,20,2> 377 us, <8,24,2> 310 us, <4,20,4> 264 us, <8,16,4> 291 us,
// <6,18,4> 260 us (the default; 490 us at 8 SMs). DEEPCOMM_COMBINE_CONFIG (tuning.hpp; 1..6) picks another
// instantiation for tuning runs; 0 is the default. 4 and 5 keep two passes of 4 vectors in flight per reducer
// lane (reduce_row_pipelined) in 16 warps (512 threads: room for its 128 registers without spills), 5 with more
// of them reducing. A plain <4,12,8> spills (136 bytes) and is not offered.
void launch_combine(const CombineArgs& args, int num_blocks, const NvlLayout& layout, const Peers& peers,
                    const WaitCtx& ctx, cudaStream_t stream) {
  DC_HOST_ASSERT(num_blocks >= 1 && num_blocks <= kMaxBlocks, "combine: num_sms out of range");
  DC_HOST_ASSERT(layout.num_ranks <= kMaxRanks, "combine: too many ranks for the NVLink transport");
  DC_HOST_ASSERT(args.hidden % 8 == 0 && args.hidden <= layout.hidden_max, "combine: hidden over the buffer's maximum");
  DC_HOST_ASSERT(args.topk <= layout.topk_max, "combine: topk over the buffer's maximum");
  DC_HOST_ASSERT(args.num_tokens <= layout.max_tokens, "combine: tokens over the buffer's maximum");
  DC_HOST_ASSERT(!args.use_fp8 || args.hidden % 128 == 0, "combine: FP8 needs hidden % 128 == 0");
  const int config = tuning(kTuneCombineConfig);
  DC_HOST_ASSERT(config >= 0 && config <= 6, "combine: DEEPCOMM_COMBINE_CONFIG must be 0..6");
  // the bulk reducers take BF16 rows from a 16-byte aligned x; else (or with no room for a row slot) the default
  const bool bulk_ran = config == 6 && !args.use_fp8 && reinterpret_cast<uintptr_t>(args.x) % 16 == 0 &&
                        launch_combine_bulk<6, 8, 4>(args, num_blocks, layout, peers, ctx, stream);
  switch (bulk_ran ? -1 : config == 6 ? 0 : config) {
    case -1: break;
    case 1: launch_combine_as<8, 24, 2>(args, num_blocks, layout, peers, ctx, stream); break;
    case 2: launch_combine_as<4, 20, 4>(args, num_blocks, layout, peers, ctx, stream); break;
    case 3: launch_combine_as<8, 16, 4>(args, num_blocks, layout, peers, ctx, stream); break;
    case 4: launch_combine_as<4, 12, 4, true>(args, num_blocks, layout, peers, ctx, stream); break;
    case 5: launch_combine_as<2, 14, 4, true>(args, num_blocks, layout, peers, ctx, stream); break;
    default: launch_combine_as<6, 18, 4>(args, num_blocks, layout, peers, ctx, stream); break;
  }
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
