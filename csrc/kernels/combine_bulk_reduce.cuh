// The BF16 combine's reducers with bulk loads (DEEPCOMM_COMBINE_CONFIG 6, a tuning variant): the warp's lane 0
// loads whole rows (our own from x; a peer's from the staging area once its chunk flag is up) into a ring of row
// slots in shared memory, ahead of the sums, token by token and holders ascending; then every lane sums its 16-byte vectors
// of the token's rows from there in fp32, source ranks ascending (the order of reduce_tokens and of the
// reference), and rounds once to bf16. The slots hold the rows in flight without registers, where the vector
// reducers hold one step's vectors per lane.
//
// Whole rows, not chunks: the copy probes (dev/profile_copy.py, "ring") found one warp's bulk loads of 3.5 KB
// chunks completing about one per microsecond whatever the slots in flight, and 14 KB rows about twice the bytes
// per second. A token with more holders than a warp has slots is summed straight from global memory by the
// caller's `sum_direct` (the vector reducers' loop); the loader skips it.
#pragma once
#include <cstdint>

#include "../../ptx/bulk.cuh"
#include "../../ptx/fence.cuh"
#include "../../ptx/sync.cuh"
#include "../runtime/wait.cuh"
#include "api.hpp"
#include "bf16_vec.cuh"
#include "combine_weights.cuh"

namespace dc {

constexpr int kRowSlotsMax = 8;  // row slots per reducer warp, at most (their barriers are static)

// Row slots per reducer warp: rows of row_bytes, reduce_warps warps sharing smem_bytes of dynamic shared memory.
__host__ __device__ inline int reduce_row_slots(int64_t row_bytes, int reduce_warps, int64_t smem_bytes) {
  const int64_t s = smem_bytes / (int64_t(reduce_warps) * row_bytes);
  return int(s < kRowSlotsMax ? s : kRowSlotsMax);
}

#if defined(__CUDACC__)
// ring: this warp's slots (dynamic shared memory, reduce_row_slots of it); bars: kRowSlotsMax barriers.
// sum_direct(holders, self_pos, t, out): the token's sum from global memory, for a token with more holders than
// slots (its peers' rows already landed).
template <int kReduce, typename SumDirect>
__device__ __forceinline__ void reduce_tokens_bulk(const CombineArgs& a, const NvlLayout& layout, const Peers& peers,
                                                   const WaitCtx& ctx, int self_base, int warp, int lane,
                                                   uint8_t* ring_all, uint64_t* bars, const SumDirect& sum_direct) {
  const int R = layout.num_ranks, rank = ctx.rank;
  uint8_t* self = peers.base[rank];
  const int64_t x_row = int64_t(a.hidden) * 2, stage_row = combine_row_bytes(a.hidden, a.topk);
  const int64_t stage_stride = int64_t(layout.max_tokens) * stage_row;  // between source ranks
  const int64_t n16 = x_row / 16;
  const int slots = reduce_row_slots(x_row, kReduce, ptx::dynamic_smem_bytes());
  uint8_t* ring = ring_all + int64_t(warp) * slots * x_row;
  const uint8_t* stage = self + layout.combine_stage;
  const auto* flags = reinterpret_cast<const uint64_t*>(self + layout.combine_flag);
  const int64_t max_chunks = combine_max_chunks(R, layout.max_tokens);
  // Lane s: first row of our tokens among rank s's received rows (which chunk flag covers a token).
  int my_base_at = 0;
  for (int q = 0; q < rank; ++q) my_base_at += lane < R ? a.count_matrix[q * R + lane] : 0;
  const int total = gridDim.x * kReduce, first_token = blockIdx.x * kReduce + warp;
  // Lane s waits for the chunk flag of rank s's row of a token (pos: our row's position there, -1 if none).
  // False: a wait timed out (recorded), every lane returns.
  const auto peers_landed = [&](int pos) -> bool {
    bool ok = true;
    if (lane < R && lane != rank && pos >= 0)
      ok = wait_flag_geq(flags + lane * max_chunks + (my_base_at + pos) / kCombineChunk, ctx.seq, ctx, lane,
                         kStageCombineToken);
    return __all_sync(0xffffffffu, ok);
  };

  if (lane == 0) {
    for (int s = 0; s < slots; ++s) ptx::mbar_init(bars + s, 1);
    ptx::fence_mbar_init();
  }
  __syncwarp();

  // The loader's position (the same in every lane): its token, the holders whose rows are still to load and
  // our own row's position. Rows are issued in the order the sums take them.
  int ld_t = first_token - total, ld_self = 0;
  uint32_t ld_left = 0;
  // the send positions of the loader's next token, loaded a token ahead: a load the warp would otherwise wait a
  // memory round trip for at every token
  int ld_ahead = (first_token < a.num_tokens && lane < R) ? a.send_pos[int64_t(first_token) * R + lane] : -1;
  bool ld_done = false;
  int64_t issued = 0, consumed = 0;
  // Loads until every slot is in flight or waits to be summed (warp-collective). False: a wait timed out.
  const auto refill = [&]() -> bool {
    while (!ld_done && issued < consumed + slots) {
      if (ld_left == 0u) {
        ld_t += total;
        if (ld_t >= a.num_tokens) {
          ld_done = true;
          break;
        }
        const int pos = ld_ahead;
        if (ld_t + total < a.num_tokens && lane < R) ld_ahead = a.send_pos[int64_t(ld_t + total) * R + lane];
        const uint32_t holders = __ballot_sync(0xffffffffu, pos >= 0);
        if (__popc(holders) > slots) continue;  // summed from global memory (sum_direct)
        if (!peers_landed(pos)) return false;
        ld_left = holders;
        ld_self = __shfl_sync(0xffffffffu, pos, rank);
        // the staging rows were written by peers through the generic proxy (acquired above): order them before
        // the bulk copies (the async proxy) that read them; our own rows come from x, written before the kernel
        if (lane == 0 && (holders & ~(1u << rank)) != 0u) ptx::fence_proxy_async_global();
        continue;
      }
      const int s = __ffs(ld_left) - 1;
      if (lane == 0) {
        const int slot = int(issued % slots);
        const uint8_t* row = s == rank ? static_cast<const uint8_t*>(a.x) + int64_t(self_base + ld_self) * x_row
                                       : stage + int64_t(ld_t) * stage_row + s * stage_stride;
        // (every lane has read the slot's last row: the __syncwarp after the sums orders those reads first)
        ptx::mbar_expect_bytes(bars + slot, uint32_t(x_row));
        ptx::bulk_load(ring + int64_t(slot) * x_row, row, uint32_t(x_row), bars + slot);
      }
      ++issued;
      ld_left &= ld_left - 1u;
    }
    return true;
  };
  // Until the i-th row issued has landed in its slot.
  const auto wait_row = [&](int64_t i) {
    while (!ptx::mbar_try_wait(bars + int(i % slots), uint32_t(i / slots) & 1u)) {
    }
  };
  // Every copy in flight completed: a warp that stops early leaves no copy writing its shared memory.
  const auto drain = [&]() {
    if (lane == 0)
      for (int64_t i = consumed; i < issued; ++i) wait_row(i);
    __syncwarp();
  };

  if (slots < 1 || !refill()) return drain();
  int next_pos = (first_token < a.num_tokens && lane < R) ? a.send_pos[int64_t(first_token) * R + lane] : -1;
  for (int t = first_token; t < a.num_tokens; t += total) {
    const int my_pos = next_pos;
    if (t + total < a.num_tokens && lane < R) next_pos = a.send_pos[int64_t(t + total) * R + lane];
    const uint32_t holders = __ballot_sync(0xffffffffu, my_pos >= 0);
    const int self_pos = __shfl_sync(0xffffffffu, my_pos, rank);
    const int h = __popc(holders);
    int4* out = reinterpret_cast<int4*>(static_cast<uint8_t*>(a.out) + int64_t(t) * x_row);
    if (h > slots) {
      if (!peers_landed(my_pos)) return drain();
      sum_direct(holders, self_pos, t, out);
    } else {
      // the token's h rows are the next h slots (none: zeros, as the vector reducers write)
      for (int j = 0; j < h; ++j) wait_row(consumed + j);
      constexpr int kVec = 4;  // vectors per lane summed together (independent shared-memory loads in flight)
      for (int64_t base = lane; base < n16; base += 32 * kVec) {
        float acc[kVec][8];
#pragma unroll
        for (int u = 0; u < kVec; ++u)
#pragma unroll
          for (int k = 0; k < 8; ++k) acc[u][k] = 0.0f;
        for (int j = 0; j < h; ++j) {
          const int4* row = reinterpret_cast<const int4*>(ring + ((consumed + j) % slots) * x_row);
#pragma unroll
          for (int u = 0; u < kVec; ++u)
            if (base + 32 * u < n16) accumulate_bf16x8(acc[u], row[base + 32 * u]);
        }
#pragma unroll
        for (int u = 0; u < kVec; ++u)
          if (base + 32 * u < n16) out[base + 32 * u] = round_bf16x8(acc[u]);
      }
      __syncwarp();
      consumed += h;
      if (!refill()) return drain();
    }
    // the weights sit after the values in a staging row
    reduce_token_weights(a, t, holders, R, rank, self_base + self_pos, stage + int64_t(t) * stage_row, stage_stride,
                         x_row, lane);
  }
}
#endif

}  // namespace dc
