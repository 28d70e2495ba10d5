// The BF16 combine's reducers with bulk loads: the warp's lane 0 loads, ahead of the sums, the row chunks its next
// tokens need (our own rows from x; a peer's from the staging area once its chunk flag is up) into a ring of
// kReduceSlots chunk slots in shared memory, and every lane sums each chunk from there in fp32, source ranks
// ascending (the order of reduce_tokens and of the reference), rounding once to bf16. The ring keeps kReduceSlots
// chunks per warp in flight without holding them in registers, where the vector reducers keep one step's vectors.
//
// The loads' order is the sums' order: token by token (the warp's tokens), chunk by chunk, holders ascending. Every
// lane keeps the same copy of the loader's position (its token, holders, chunk, source), advanced at points where
// the whole warp is converged, so that a token's flags are waited for by the lanes of their ranks as in
// reduce_tokens; only lane 0 issues the copies.
#pragma once
#include <cstdint>

#include "../../ptx/bulk.cuh"
#include "../../ptx/fence.cuh"
#include "../runtime/wait.cuh"
#include "api.hpp"
#include "bf16_vec.cuh"
#include "bulk_rows.cuh"
#include "combine_weights.cuh"

namespace dc {

constexpr int kReduceSlots = 6;                          // chunk slots per reducer warp
constexpr int kReduceVecMax = kBulkChunkMax / 16 / 32;   // 16-byte vectors per lane in a chunk, at most

// One reducer warp's shared memory for rows of row_bytes.
__host__ __device__ inline int reduce_warp_smem(int64_t row_bytes) {
  return kReduceSlots * BulkChunking(row_bytes).bytes;
}

#if defined(__CUDACC__)
template <int kReduce>
__device__ __forceinline__ void reduce_tokens_bulk(const CombineArgs& a, const NvlLayout& layout, const Peers& peers,
                                                   const WaitCtx& ctx, int self_base, int warp, int lane,
                                                   uint8_t* ring, uint64_t* bars) {
  const int R = layout.num_ranks, rank = ctx.rank;
  uint8_t* self = peers.base[rank];
  const int64_t x_row = int64_t(a.hidden) * 2, stage_row = combine_row_bytes(a.hidden, a.topk);
  const int64_t stage_stride = int64_t(layout.max_tokens) * stage_row;  // between source ranks
  const BulkChunking ch(x_row);
  const auto* flags = reinterpret_cast<const uint64_t*>(self + layout.combine_flag);
  const int64_t max_chunks = combine_max_chunks(R, layout.max_tokens);
  const auto chunk_bytes = [&](int c) {
    return uint32_t(c + 1 < ch.per_row ? ch.bytes : x_row - int64_t(c) * ch.bytes);
  };
  // Lane s: first row of our tokens among rank s's received rows (which chunk flag covers a token).
  int my_base_at = 0;
  for (int q = 0; q < rank; ++q) my_base_at += lane < R ? a.count_matrix[q * R + lane] : 0;
  const int total = gridDim.x * kReduce, first_token = blockIdx.x * kReduce + warp;

  if (lane == 0) {
    for (int s = 0; s < kReduceSlots; ++s) ptx::mbar_init(bars + s, 1);
    ptx::fence_mbar_init();
  }
  __syncwarp();

  // The loader's position (the same in every lane): its token, that token's holders and our row of it, the next
  // chunk and source to load; holders 0: the token is done (or has no holder), the next one comes first.
  int ld_t = first_token - total, ld_self = 0, ld_c = 0, ld_s = 0;
  uint32_t ld_holders = 0;
  bool ld_done = false;
  int64_t issued = 0, consumed = 0;
  // The loader's next token with a holder: its holders, and its peers' chunk flags waited for. False: a wait
  // timed out (recorded), every lane returns.
  const auto next_token = [&]() -> bool {
    ld_t += total;
    if (ld_t >= a.num_tokens) {
      ld_done = true;
      return true;
    }
    const int pos = lane < R ? a.send_pos[int64_t(ld_t) * R + lane] : -1;
    bool ok = true;
    if (lane < R && lane != rank && pos >= 0)
      ok = wait_flag_geq(flags + lane * max_chunks + (my_base_at + pos) / kCombineChunk, ctx.seq, ctx, lane,
                         kStageCombineToken);
    if (!__all_sync(0xffffffffu, ok)) return false;
    ld_holders = __ballot_sync(0xffffffffu, pos >= 0);
    ld_self = __shfl_sync(0xffffffffu, pos, rank);
    ld_s = __ffs(ld_holders) - 1;
    ld_c = 0;
    // the staging rows were written by peers through the generic proxy (acquired above): order them before the
    // bulk copies (the async proxy) that read them; our own rows come from x, written before the kernel
    if (lane == 0 && (ld_holders & ~(1u << rank)) != 0u) ptx::fence_proxy_async_global();
    return true;
  };
  // Loads until kReduceSlots chunks are in flight or consumed-and-waiting (warp-collective).
  const auto refill = [&]() -> bool {
    while (!ld_done && issued < consumed + kReduceSlots) {
      if (ld_holders == 0u) {
        if (!next_token()) return false;
        continue;
      }
      if (lane == 0) {
        const int slot = int(issued % kReduceSlots);
        const uint8_t* row = ld_s == rank
            ? static_cast<const uint8_t*>(a.x) + int64_t(self_base + ld_self) * x_row
            : self + layout.combine_stage + int64_t(ld_t) * stage_row + ld_s * stage_stride;
        // (every lane has read the slot's last chunk: the __syncwarp after the sums orders those reads first)
        ptx::mbar_expect_bytes(bars + slot, chunk_bytes(ld_c));
        ptx::bulk_load(ring + int64_t(slot) * ch.bytes, row + int64_t(ld_c) * ch.bytes, chunk_bytes(ld_c),
                       bars + slot);
      }
      ++issued;
      const uint32_t above = ld_holders & ~((2u << ld_s) - 1u);
      if (above != 0u) {
        ld_s = __ffs(above) - 1;
      } else if (++ld_c < ch.per_row) {
        ld_s = __ffs(ld_holders) - 1;
      } else {
        ld_holders = 0u;
      }
    }
    return true;
  };
  // Every copy in flight completed: a warp that stops early leaves no copy writing its shared memory.
  const auto drain = [&]() {
    if (lane == 0)
      for (int64_t i = consumed; i < issued; ++i)
        while (!ptx::mbar_try_wait(bars + int(i % kReduceSlots), uint32_t(i / kReduceSlots) & 1u)) {
        }
    __syncwarp();
  };

  if (!refill()) return drain();
  int next_pos = (first_token < a.num_tokens && lane < R) ? a.send_pos[int64_t(first_token) * R + lane] : -1;
  for (int t = first_token; t < a.num_tokens; t += total) {
    const int my_pos = next_pos;
    if (t + total < a.num_tokens && lane < R) next_pos = a.send_pos[int64_t(t + total) * R + lane];
    const uint32_t holders = __ballot_sync(0xffffffffu, my_pos >= 0);
    const int self_pos = __shfl_sync(0xffffffffu, my_pos, rank);
    int4* out = reinterpret_cast<int4*>(static_cast<uint8_t*>(a.out) + int64_t(t) * x_row);
    for (int c = 0; c < ch.per_row; ++c) {
      const int nvec = int(chunk_bytes(c) / 16);
      float acc[kReduceVecMax][8];
#pragma unroll
      for (int u = 0; u < kReduceVecMax; ++u)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[u][j] = 0.0f;
      for (uint32_t rest = holders; rest != 0u; rest &= rest - 1u) {
        const int slot = int(consumed % kReduceSlots);
        while (!ptx::mbar_try_wait(bars + slot, uint32_t(consumed / kReduceSlots) & 1u)) {
        }
        const int4* chunk = reinterpret_cast<const int4*>(ring + int64_t(slot) * ch.bytes);
#pragma unroll
        for (int u = 0; u < kReduceVecMax; ++u)
          if (lane + 32 * u < nvec) accumulate_bf16x8(acc[u], chunk[lane + 32 * u]);
        __syncwarp();
        ++consumed;
        if (!refill()) return drain();
      }
      // no holder: zeros, as the vector reducers write
#pragma unroll
      for (int u = 0; u < kReduceVecMax; ++u)
        if (lane + 32 * u < nvec) out[int64_t(c) * (ch.bytes / 16) + lane + 32 * u] = round_bf16x8(acc[u]);
    }
    // the weights sit after the values in a staging row
    reduce_token_weights(a, t, holders, R, rank, self_base + self_pos,
                         self + layout.combine_stage + int64_t(t) * stage_row, stage_stride, x_row, lane);
  }
}
#endif

}  // namespace dc
