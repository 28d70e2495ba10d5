// The receive half of the low-latency dispatch (ll_dispatch.cu has the kernel, the launcher and the overview):
// poll the tagged counts for the expert bases, wait for every block of every rank, fan the staged tokens out to the
// packed expert rows, record where each entry landed, write the output metadata. Included by ll_dispatch.cu only.
#pragma once

#include "api.hpp"
#include "ll_common.cuh"

namespace dc {

namespace {

constexpr int kScalesAhead = 2;  // FP8 scales per lane loaded with a row's first chunk (64 cover hidden 8192)

// Fan-out: warps take (source rank, token, chunk) items and copy the staged row to each of its entries here, and
// record where each entry landed (for the combine). The row's loads (and, for a first chunk, its FP8 scales) go out
// with its keys: a token not sent here is loaded for nothing, cheaper than waiting. kUnroll: 16-byte vectors per
// lane per item (chunks of 512 * kUnroll bytes): 4 for FP8 rows and 8 for BF16 ones, about one item per warp for
// either at 128 tokens of hidden 7168.
template <int kUnroll>
__device__ __forceinline__ void fan_out_rows(const LlDispatchArgs& a, const LlLayout& l, uint8_t* self,
                                             const int* base, const int* n) {
  constexpr int kChunkBytes = 32 * 16 * kUnroll;
  const int R = l.num_ranks, slot = a.slot, K = a.topk, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool use_fp8 = a.use_fp8;
  const int64_t rows = l.rows_per_expert();
  const int64_t x_bytes = use_fp8 ? l.hidden : l.hidden * 2, spr = l.scales_per_row(), n16 = x_bytes / 16;
  const int nchunks = int((x_bytes + kChunkBytes - 1) / kChunkBytes), items = ll_item_count(n, R, nchunks);
  uint8_t* recv_x = self + l.recv_x_at(slot);
  auto* recv_scales = reinterpret_cast<float*>(self + l.recv_scales_at(slot));
  int* src_info = reinterpret_cast<int*>(self + l.out_src_info_at(slot));
  const int total_warps = gridDim.x * kLlWarps;
  for (int item = blockIdx.x * kLlWarps + warp; item < items; item += total_warps) {
    int s, rest;
    ll_item_source(n, R, nchunks, item, &s, &rest);
    const int t = rest / nchunks, c = rest % nchunks;
    const int* meta = reinterpret_cast<const int*>(self + l.meta_at(slot, s, t));
    const int key = lane < K ? ptx::ld_volatile_s32(meta + lane) : -1;
    const auto* src = reinterpret_cast<const int4*>(self + l.stage_x_at(slot, s, t));
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = int64_t(c) * (kChunkBytes / 16) + u * 32 + lane;
      if (i < n16) v[u] = ptx::ld_relaxed_gpu_v4(src + i);
    }
    const auto* sc = reinterpret_cast<const uint32_t*>(self + l.stage_scales_at(slot, s, t));
    const bool scales = use_fp8 && c == 0;
    float sv[kScalesAhead];
#pragma unroll
    for (int u = 0; u < kScalesAhead; ++u) {
      const int j = u * 32 + lane;
      sv[u] = scales && j < spr ? __uint_as_float(ptx::ld_relaxed_gpu_u32(sc + j)) : 0.0f;
    }
    // a row past the expert's R * M (only duplicate ids, reported, get there) is dropped
    const int row = key >= 0 ? base[(key >> 16) * R + s] + (key & 0xffff) : -1;
    const int64_t entry = key >= 0 && row < rows ? (key >> 16) * rows + row : -1;
    if (c == 0 && lane < K)  // for the combine
      reinterpret_cast<int*>(self + l.entry_at(slot, s, t))[lane] = int(entry);
    const uint32_t mine = __ballot_sync(0xffffffffu, entry >= 0);
    if (!mine) continue;
    for (uint32_t m = mine; m; m &= m - 1) {
      const int64_t e = __shfl_sync(0xffffffffu, entry, __ffs(m) - 1);
      auto* dst = reinterpret_cast<int4*>(recv_x + e * x_bytes);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = int64_t(c) * (kChunkBytes / 16) + u * 32 + lane;
        if (i < n16) ptx::st_na_v4(dst + i, v[u]);
      }
      if (!scales) continue;
#pragma unroll
      for (int u = 0; u < kScalesAhead; ++u)
        if (u * 32 + lane < spr) recv_scales[e * spr + u * 32 + lane] = sv[u];
    }
    if (c != 0) continue;
    if (entry >= 0) src_info[entry] = t;
    // scales past the ones loaded ahead (hidden over 8192): each loaded once, then stored to every entry
    for (int j0 = kScalesAhead * 32; use_fp8 && j0 < spr; j0 += 32) {
      const int j = j0 + lane;
      const float f = j < spr ? __uint_as_float(ptx::ld_relaxed_gpu_u32(sc + j)) : 0.0f;
      for (uint32_t m = mine; m; m &= m - 1) {
        const int64_t e = __shfl_sync(0xffffffffu, entry, __ffs(m) - 1);
        if (j < spr) recv_scales[e * spr + j] = f;
      }
    }
  }
}

// calls: the slot's send count this receive waits for (every rank's).
__device__ __forceinline__ void dispatch_recv_phase(const LlDispatchArgs& a, const LlLayout& l, const LlPeers& peers,
                                                    const WaitCtx& ctx, LlRanks alive, uint64_t calls, int* smem) {
  const int R = l.num_ranks, L = l.local_experts(), rank = ctx.rank, slot = a.slot;
  const int K = a.topk, tid = threadIdx.x, warp = tid >> 5;
  const int64_t rows = l.rows_per_expert();
  uint8_t* self = peers.at(rank);
  int* base = smem;               // [L][R]
  int* total = smem + L * R;      // [L]
  int* n = total + L;             // [R] tokens of each source
  // every rank's words first: on a difference (or a rank that rejected its call) nothing lands in recv_x here
  if (ll_agree_on(a.agree, l) && !ll_agree(self, l, alive, kLlDispatch, slot, a.agree, calls, ctx)) return;
  // With put peers the words come in the data put and are compared once the arrival words are in; the counts are
  // not polled before then (a disagreeing rank may never tag some of them).
  const bool inbox_agree = ll_inbox_agree_on(a.agree, l);
  // the bases come from the tagged counts, which land before the rows: known by the time the arrivals are in
  if (!inbox_agree && !ll_expert_bases(self, l, slot, rank, alive, calls, ctx, kStageLlDispatchData, base, total, n))
    return;
  ll_trace(a.trace, kLlTraceRecvMeta);
  if (!ll_wait_arrivals(self, l, kLlDispatch, slot, calls, alive, ctx, kStageLlDispatchData)) return;
  if (inbox_agree && !ll_inbox_agree(self, l, alive, kLlDispatch, slot, a.agree, calls, ctx, false)) return;
  // A put peer's counts come in its data put, whose 8-byte words nothing promises to land whole (a word could show
  // the new tag over the old count); behind the arrival words (the put's flags, after a quiet) they are final, so
  // a buffer with put peers reads them again. NVLink stores land whole: no second read there.
  if (l.with_outbox && !ll_expert_bases(self, l, slot, rank, alive, calls, ctx, kStageLlDispatchData, base, total, n))
    return;
  ll_trace(a.trace, kLlTraceArrived);
  if (a.use_fp8)
    fan_out_rows<4>(a, l, self, base, n);
  else
    fan_out_rows<8>(a, l, self, base, n);
  const int lane = tid & 31;
  int* src_info = reinterpret_cast<int*>(self + l.out_src_info_at(slot));

  // Bad input some rank passed in this call (report_bad_input): one record, the same on every rank: ids out of range
  // before duplicates, lowest rank first. Warp 0 of the last block, lane j loading rank g + j's word of each kind,
  // 32 ranks g.. per pass; off the rows' path. Both loops are the same in every lane: they end together.
  if (blockIdx.x == gridDim.x - 1 && warp == 0) {
    bool reported = false;
    for (int which = 0; which < 2 && !reported; ++which) {
      for (int g = 0; g < R && !reported; g += 32) {
        const int s = g + lane;
        const bool bad = s < R && ll_is_alive(alive, s) &&
                         ptx::ld_relaxed_sys_u64(reinterpret_cast<const uint64_t*>(
                             self + l.input_err_at(slot, which, s))) == calls;
        const uint32_t found = __ballot_sync(0xffffffffu, bad);
        if (found == 0u) continue;
        if (lane == __ffs(found) - 1)
          report_input_error(ctx, s, which == 0 ? kStageLlInvalidIds : kStageLlDuplicateIds);
        reported = true;
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
      out_layout[2 * i + 1] = ll_count(self, l, slot, alive, s, rank * L + le);
      if (s == 0) out_count[le] = min(int64_t(total[le]), rows);
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
      for (int s = 0; s < rank; ++s) pos += ll_count(self, l, slot, alive, s, key >> 16);
      if (pos >= rows) pos = -1;  // dropped at the owner (duplicate ids)
    }
    recv_pos[p] = pos;
  }
  __syncthreads();
  ll_trace(a.trace, kLlTraceEnd);
}

}  // namespace

}  // namespace dc
