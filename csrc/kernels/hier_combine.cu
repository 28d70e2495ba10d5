// The internode hierarchical combine (contract in hier_kernels.hpp), one launch:
//   nvl blocks:  block 0 frees our area at every node GPU (and puts our words into every node GPU's strip, with
//                words_at >= 0); all build our held rows for each source s (from the expert outputs, quantized
//                with fp8) in the area of s's forwarder (node GPU s % G) once it freed it; the last one raises
//                arrive everywhere.
//   rdma blocks: once every node GPU arrived, reduce each rail source's rows into its send section (a one-holder
//                row copied as held, the others as fp32 partials) and count done; once every rdma block is done
//                and every rail peer's block landed, sum each token's node partials into out_x / out_w.
//   poster:      one exchange round per rail peer once every rdma block is done; then the NIC blocks (emulated).
// Every sum starts at +0 and adds with __fadd_rn, dequantization is one __fmul_rn (nothing may contract into an
// FMA): node GPUs ascending within a node, then nodes ascending, as the CPU reference adds them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "../runtime/cuda_check.hpp"
#include "bf16_vec.cuh"
#include "combine_fp8.cuh"
#include "hier_roles.cuh"

namespace dc {

using namespace transport;

namespace {

using namespace hier;

constexpr int kWarps = kHierThreads / 32;
constexpr int kUnroll = 2;  // 8-element chunks per lane in flight
constexpr uint32_t kFull = 0xffffffffu;

enum RowFmt : int { kBf16 = 0, kFp8 = 1, kF32 = 2 };  // x as bf16, e4m3 + fp32 scales [H/128], or fp32

// One warp's addends for the row it sums, in summation order (at most 32: one per node GPU or per node).
struct Sources {
  const uint8_t* x[32];
  const float* w[32];
  int fmt[32];
};

// Lane l offers addend l; the valid ones are packed in lane order. Returns how many.
__device__ __forceinline__ int set_sources(Sources& s, bool valid, const uint8_t* x, const float* w, int fmt,
                                           int lane) {
  const uint32_t mask = __ballot_sync(kFull, valid);
  __syncwarp();  // the previous row's readers are done with s
  if (valid) {
    const int p = __popc(mask & ((1u << lane) - 1u));
    s.x[p] = x;
    s.w[p] = w;
    s.fmt[p] = fmt;
  }
  __syncwarp();
  return __popc(mask);
}

// The 16-byte vector path needs whole 8-element chunks and every row (and dst) 16-byte aligned.
__device__ __forceinline__ bool vector_ok(int hidden, bool valid, const void* x, const void* dst) {
  const uint32_t low = __reduce_or_sync(kFull, valid ? uint32_t(reinterpret_cast<uintptr_t>(x)) : 0u);
  return hidden % 8 == 0 && ((low | uint32_t(reinterpret_cast<uintptr_t>(dst))) & 15u) == 0u;
}

// Chunks c0 + 32u (8 elements each) of x as fp32; the loads of all kUnroll chunks are issued before any use.
// Rows may have been written during the launch (ordered by an acquire): coherent loads only.
__device__ __forceinline__ void load_chunks(const uint8_t* x, int fmt, int hidden, int64_t c0, int64_t nch,
                                            float (&f)[kUnroll][8]) {
  if (fmt == kFp8) {
    uint2 q[kUnroll];
    uint32_t sc[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + 32 * u;
      q[u] = c < nch ? ptx::ld_relaxed_gpu_v2(reinterpret_cast<const uint2*>(x) + c) : make_uint2(0u, 0u);
      sc[u] = c < nch ? ptx::ld_relaxed_gpu_u32(reinterpret_cast<const uint32_t*>(x + hidden) + c / 16) : 0u;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dequant_e4m3x8(q[u], __uint_as_float(sc[u]), f[u]);
  } else if (fmt == kF32) {
    int4 q[kUnroll][2];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + 32 * u;
      const int4* p = reinterpret_cast<const int4*>(x) + 2 * c;
      q[u][0] = c < nch ? ptx::ld_relaxed_gpu_v4(p) : make_int4(0, 0, 0, 0);
      q[u][1] = c < nch ? ptx::ld_relaxed_gpu_v4(p + 1) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        f[u][4 * h] = __int_as_float(q[u][h].x);
        f[u][4 * h + 1] = __int_as_float(q[u][h].y);
        f[u][4 * h + 2] = __int_as_float(q[u][h].z);
        f[u][4 * h + 3] = __int_as_float(q[u][h].w);
      }
  } else {
    int4 q[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t c = c0 + 32 * u;
      q[u] = c < nch ? ptx::ld_relaxed_gpu_v4(reinterpret_cast<const int4*>(x) + c) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) unpack_bf16x8(q[u], f[u]);
  }
}

// Element j of x as fp32 (the scalar path: odd hidden, or a row not 16-byte aligned).
__device__ __forceinline__ float load_one(const uint8_t* x, int fmt, int hidden, int64_t j) {
  if (fmt == kF32) return __uint_as_float(ptx::ld_relaxed_gpu_u32(reinterpret_cast<const uint32_t*>(x) + j));
  if (fmt == kFp8) {
    const auto q = static_cast<__nv_fp8_storage_t>(*reinterpret_cast<const volatile uint8_t*>(x + j));
    const auto* scales = reinterpret_cast<const uint32_t*>(x + hidden);
    const float scale = __uint_as_float(ptx::ld_relaxed_gpu_u32(scales + j / 128));
    return __fmul_rn(__half2float(__half(__nv_cvt_fp8_to_halfraw(q, __NV_E4M3))), scale);
  }
  return __uint_as_float(uint32_t(*reinterpret_cast<const volatile uint16_t*>(x + 2 * j)) << 16);
}

// The warp sums its n addends, in order from +0, into dst_x (fp32, or bf16 rounded to nearest even when kToBf16)
// and, when dst_w is set, their weights into dst_w (fp32).
template <bool kToBf16>
__device__ __forceinline__ void sum_row(const Sources& s, int n, int hidden, int topk, void* dst_x, float* dst_w,
                                        bool vec, int lane) {
  if (vec) {
    const int64_t nch = hidden / 8;
    for (int64_t c0 = lane; c0 < nch; c0 += 32 * kUnroll) {
      float acc[kUnroll][8];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[u][k] = 0.0f;
      for (int i = 0; i < n; ++i) {
        float v[kUnroll][8];
        load_chunks(s.x[i], s.fmt[i], hidden, c0, nch, v);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
          for (int k = 0; k < 8; ++k) acc[u][k] = __fadd_rn(acc[u][k], v[u][k]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t c = c0 + 32 * u;
        if (c >= nch) break;
        if constexpr (kToBf16) {
          reinterpret_cast<int4*>(dst_x)[c] = round_bf16x8(acc[u]);
        } else {
          int4* d = reinterpret_cast<int4*>(dst_x) + 2 * c;
          d[0] = make_int4(__float_as_int(acc[u][0]), __float_as_int(acc[u][1]), __float_as_int(acc[u][2]),
                           __float_as_int(acc[u][3]));
          d[1] = make_int4(__float_as_int(acc[u][4]), __float_as_int(acc[u][5]), __float_as_int(acc[u][6]),
                           __float_as_int(acc[u][7]));
        }
      }
    }
  } else {
    for (int64_t j = lane; j < hidden; j += 32) {
      float acc = 0.0f;
      for (int i = 0; i < n; ++i) acc = __fadd_rn(acc, load_one(s.x[i], s.fmt[i], hidden, j));
      if constexpr (kToBf16)
        reinterpret_cast<uint16_t*>(dst_x)[j] = __bfloat16_as_ushort(__float2bfloat16_rn(acc));
      else
        reinterpret_cast<float*>(dst_x)[j] = acc;
    }
  }
  if (dst_w == nullptr) return;
  for (int k = lane; k < topk; k += 32) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i)
      acc = __fadd_rn(acc, __uint_as_float(ptx::ld_relaxed_gpu_u32(reinterpret_cast<const uint32_t*>(s.w[i]) + k)));
    dst_w[k] = acc;
  }
}

// A warp copies one row (bytes % 16 == 0) with coherent loads; byte by byte if an address is not 16-byte aligned.
__device__ __forceinline__ void copy_row(const uint8_t* src, uint8_t* dst, int64_t bytes, int lane) {
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15u) == 0u) {
    warp_copy_fresh(reinterpret_cast<const int4*>(src), reinterpret_cast<int4*>(dst), bytes / 16, lane);
  } else {
    for (int64_t j = lane; j < bytes; j += 32) dst[j] = *reinterpret_cast<const volatile uint8_t*>(src + j);
  }
}

// The first of `rows` items (after `before` items of earlier groups) that warp gw of nw takes: items are dealt
// round-robin over the concatenation of the groups, so the load stays balanced however the rows are split.
__device__ __forceinline__ int64_t first_item(int64_t gw, int64_t nw, int64_t before) {
  const int64_t i = (gw - before) % nw;
  return i < 0 ? i + nw : i;
}

// rdma blocks, first part: the node partial (or the held row) of every row of every rail source, into its section.
__device__ __forceinline__ void reduce_rows(const HierCombineArgs& a, Sources& src, int64_t gw, int64_t nw,
                                            int lane) {
  const HierTopo& t = a.topo;
  const int G = t.gpus;
  const uint8_t* area = a.nvl.area[t.local];
  const int held_fmt = a.fp8 ? kFp8 : kBf16;
  int64_t before = 0;
  for (int m = 0; m < t.num_nodes; ++m) {
    const int rows = a.rows_from[m];
    uint8_t* section = a.rdma.send + int64_t(rail_rank(t, m)) * a.rdma.slot_bytes + a.rdma.header_bytes;
    if (rows <= 0) continue;
    // Another node's block: one-holder rows as held first, then the fp32 partials.
    uint8_t* partials = m == t.node ? section : section + int64_t(a.singles[m]) * a.held_stride;
    const int64_t my_area_off = lane < G ? a.area_off[m * G + lane] : 0;
    for (int64_t i = first_item(gw, nw, before); i < rows; i += nw) {
      const int32_t* r = a.route + (int64_t(m) * a.max_rows + i) * (G + 1);
      const int rg = lane < G ? r[lane] : -1;
      const int k = r[G];
      const uint32_t holders = __ballot_sync(kFull, rg >= 0);
      if (m != t.node && k >= 0) {
        if (holders == 0u) continue;  // cannot happen with a consistent route
        const int g = __ffs(holders) - 1;
        const int64_t off = __shfl_sync(kFull, my_area_off, g) + int64_t(__shfl_sync(kFull, rg, g)) * a.held_stride;
        copy_row(area + off, section + int64_t(k) * a.held_stride, a.held_stride, lane);
        continue;
      }
      const uint8_t* x = nullptr;
      const float* w = nullptr;
      int fmt = held_fmt;
      if (rg >= 0 && m == t.node && lane == t.local) {  // our own rows for our own tokens: never quantized
        const int64_t row = int64_t(a.own_begin) + rg;
        x = reinterpret_cast<const uint8_t*>(a.own_x + row * a.hidden);
        w = a.topk > 0 ? a.own_w + row * a.topk : nullptr;
        fmt = kBf16;
      } else if (rg >= 0) {
        x = area + my_area_off + int64_t(rg) * a.held_stride;
        w = reinterpret_cast<const float*>(x + a.w_off);
      }
      const int n = set_sources(src, rg >= 0, x, w, fmt, lane);
      uint8_t* dst = m == t.node ? section + i * a.partial_stride : partials + int64_t(-k - 1) * a.partial_stride;
      const bool vec = vector_ok(a.hidden, rg >= 0, x, dst);
      sum_row<false>(src, n, a.hidden, a.topk, dst,
                     a.topk > 0 ? reinterpret_cast<float*>(dst + 4 * int64_t(a.hidden)) : nullptr, vec, lane);
    }
    before += rows;
  }
}

// rdma blocks, second part: each token's node partials, nodes ascending, into out_x / out_w.
__device__ __forceinline__ void sum_tokens(const HierCombineArgs& a, Sources& src, int64_t gw, int64_t nw,
                                           int lane) {
  const HierTopo& t = a.topo;
  const int N = t.num_nodes;
  const int held_fmt = a.fp8 ? kFp8 : kBf16;
  const uint8_t* base = nullptr;  // lane m: node m's block (ours: our own section)
  if (lane < N)
    base = (lane == t.node ? a.rdma.send + int64_t(t.rank) * a.rdma.slot_bytes
                           : a.rdma.recv + int64_t(rail_rank(t, lane)) * a.rdma.slot_bytes) +
           a.rdma.header_bytes;
  for (int64_t tok = gw; tok < a.num_tokens; tok += nw) {
    // o >= 0: an fp32 partial at that byte offset of node m's block; <= -2: a held row at -o - 2; -1: nothing
    int64_t o = -1;
    if (lane < N) {
      const int slot = a.rdma_slot[tok * N + lane];
      if (slot >= 0 && lane == t.node) {
        o = int64_t(slot) * a.partial_stride;
      } else if (slot >= 0) {
        const int k = a.held_slot[tok * N + lane];
        o = k >= 0 ? -int64_t(k) * a.held_stride - 2
                   : int64_t(a.one_held[lane]) * a.held_stride + int64_t(-k - 1) * a.partial_stride;
      }
    }
    const bool valid = o != -1;
    const uint8_t* x = nullptr;
    const float* w = nullptr;
    if (o >= 0) {  // an fp32 partial
      x = base + o;
      w = reinterpret_cast<const float*>(x + 4 * int64_t(a.hidden));
    } else if (valid) {  // a held row (bf16 or e4m3 + scales)
      x = base + (-o - 2);
      w = reinterpret_cast<const float*>(x + a.w_off);
    }
    const int n = set_sources(src, valid, x, w, o >= 0 ? kF32 : held_fmt, lane);
    uint16_t* dst = a.out_x + tok * a.hidden;
    const bool vec = vector_ok(a.hidden, valid, x, dst);
    sum_row<true>(src, n, a.hidden, a.topk, dst, a.out_w != nullptr && a.topk > 0 ? a.out_w + tok * a.topk : nullptr,
                  vec, lane);
  }
}

__device__ __forceinline__ void rdma_role(const HierCombineArgs& a, const WaitCtx& ctx, int b, int warp, int lane) {
  __shared__ Sources sources[kWarps];
  const HierTopo& t = a.topo;
  for (int g = 0; g < t.gpus; ++g)
    if (!block_wait_node_word(a.nvl.arrive_words[t.local], g, a.nvl.epoch, t, ctx, kStageHierArrive)) return;
  const int G = t.gpus, P = t.num_nodes - 1;
  const bool words = b == 0 && a.nvl.words_at >= 0;
  uint8_t* strip = a.nvl.area[t.local] + a.nvl.words_at;  // ours (used only with words)
  if (words)  // our node's words, local index order, into the header of every other node's section (posted below)
    copy_headers(
        P * G,
        [&](int i) -> const uint8_t* { return strip + int64_t(words_slot(t, t.node, i % G)) * kRailHeaderBytes; },
        [&](int i) -> uint8_t* {
          return a.rdma.send + int64_t(rail_rank(t, peer_node(t, i / G))) * a.rdma.slot_bytes +
                 int64_t(i % G) * kRailHeaderBytes;
        });
  const int64_t nw = int64_t(a.rdma_blocks) * kWarps, gw = int64_t(b) * kWarps + warp;
  reduce_rows(a, sources[warp], gw, nw, lane);
  block_done(&a.counters[1]);
  // Our own section is written by every rdma block; the other nodes' blocks land through the NIC.
  if (!block_wait_count(&a.counters[1], uint32_t(a.rdma_blocks), ctx)) return;
  for (int m = 0; m < t.num_nodes; ++m)
    if (m != t.node && !block_wait_signal(a.rdma, rail_rank(t, m), ctx)) return;
  if (words)  // the words of every other node's GPUs (the headers its rail rank sent us) into our strip
    copy_headers(
        P * G,
        [&](int i) -> const uint8_t* {
          return a.rdma.recv + int64_t(rail_rank(t, peer_node(t, i / G))) * a.rdma.slot_bytes +
                 int64_t(i % G) * kRailHeaderBytes;
        },
        [&](int i) -> uint8_t* {
          return strip + int64_t(words_slot(t, peer_node(t, i / G), i % G)) * kRailHeaderBytes;
        });
  sum_tokens(a, sources[warp], gw, nw, lane);
}

// A warp builds held row j (runtime/hier_rows.hpp: HierHeldRow) from own_x row j (bf16 16-byte vectors, or
// quantized to e4m3 + scales as deepcomm/fp8.py does) and own_w row j into dst (a node GPU's area). own_x and
// own_w are the caller's tensors, never written during the launch.
__device__ __forceinline__ void store_held_row(const HierCombineArgs& a, const HierHeldRow& h, int64_t j, uint8_t* dst,
                                               int lane) {
  const auto* x = reinterpret_cast<const int4*>(a.own_x + j * a.hidden);
  const int64_t n16 = a.hidden / 8;  // 16-byte vectors of the bf16 row
  if (a.fp8)
    warp_store_row_e4m3<kUnroll>(x, dst, n16, lane);
  else
    warp_copy_v4<4>(x, reinterpret_cast<int4*>(dst), n16, lane);
  for (int64_t o = h.x_bytes + 4 * int64_t(lane); o < h.stride; o += 4 * 32)
    ptx::st_na_u32(reinterpret_cast<uint32_t*>(dst + o), held_row_tail_word(h, a.own_w, a.topk, j, o));
}

__device__ __forceinline__ void nvl_role(const HierCombineArgs& a, const WaitCtx& ctx, int b, int warp, int lane) {
  const HierTopo& t = a.topo;
  const uint64_t epoch = a.nvl.epoch;
  if (b == 0) raise_node_words(a.nvl.free_words, t, epoch);  // our stream finished reading our area
  for (int g = 0; g < t.gpus; ++g)
    if (!block_wait_node_word(a.nvl.free_words[t.local], g, epoch, t, ctx, kStageHierFree)) return;
  if (b == 0 && a.nvl.words_at >= 0)  // our words (our own section's front) into our slot of every node GPU's strip
    copy_headers(
        t.gpus, [&](int) -> const uint8_t* { return a.rdma.send + int64_t(t.rank) * a.rdma.slot_bytes; },
        [&](int g) -> uint8_t* {
          return a.nvl.area[g] + a.nvl.words_at + int64_t(words_slot(t, t.node, t.local)) * kRailHeaderBytes;
        });
  const int64_t nw = int64_t(a.nvl_blocks) * kWarps, gw = int64_t(b) * kWarps + warp;
  const HierHeldRow h(a.hidden, a.topk, a.fp8);
  const int64_t stride = a.held_stride;
  int64_t before = 0;
  for (int s = 0; s < t.num_nodes * t.gpus; ++s) {
    const int64_t rows = a.gather[3 * s + 1];
    if (s == t.rank || rows <= 0) continue;
    const int64_t first = a.gather[3 * s];  // held row of s's first row here
    uint8_t* to = a.nvl.area[s % t.gpus] + a.gather[3 * s + 2];
    for (int64_t k = first_item(gw, nw, before); k < rows; k += nw)
      store_held_row(a, h, first + k, to + k * stride, lane);
    before += rows;
  }
  // The last nvl block: every block's rows are ordered before arrive (block_done fences at system scope).
  if (block_done(&a.counters[2]) == uint32_t(a.nvl_blocks - 1)) raise_node_words(a.nvl.arrive_words, t, epoch);
}

static_assert(sizeof(HierCombineArgs) < 4000, "HierCombineArgs must fit the kernel parameters");

__global__ void __launch_bounds__(kHierThreads) hier_combine_kernel(HierCombineArgs a, KeyTable keys, WaitCtx ctx_in) {
  const WaitCtx& ctx = ctx_in;  // its seq is the launch's round (hier_launch.hpp)
  zero_next_counters(a.counters_next);
  const int b = int(blockIdx.x), warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (b < a.rdma_blocks) {
    rdma_role(a, ctx, b, warp, lane);
  } else if (b < a.rdma_blocks + a.nvl_blocks) {
    nvl_role(a, ctx, b - a.rdma_blocks, warp, lane);
  } else if (b == a.rdma_blocks + a.nvl_blocks) {
    const HierTopo& t = a.topo;
    auto bytes_of = [&](int j) -> uint64_t {
      const int m = peer_node(t, j);
      const int single = a.singles[m];
      return uint64_t(single) * a.held_stride + uint64_t(a.rows_from[m] - single) * a.partial_stride;
    };
    poster_block(a.rdma, a.topo, &a.counters[1], uint32_t(a.rdma_blocks), bytes_of, ctx);
  } else {
    nic_block(a.rdma, b - a.rdma_blocks - a.nvl_blocks - 1, keys, ctx);
  }
}

}  // namespace

void launch_hier_combine(const HierCombineArgs& a, const KeyTable& keys, const WaitCtx& ctx, cudaStream_t stream) {
  const HierTopo& t = a.topo;
  const int blocks = checked_grid_blocks(t, a.rdma, a.rdma_blocks, a.nvl_blocks, "hier_combine");
  DC_HOST_ASSERT(a.hidden >= 1 && a.topk >= 0 && a.num_tokens >= 0, "hier_combine: bad hidden, topk or num_tokens");
  DC_HOST_ASSERT(!a.fp8 || a.hidden % 128 == 0, "hier_combine: fp8 needs hidden % 128 == 0");
  const HierHeldRow h(a.hidden, a.topk, a.fp8);
  DC_HOST_ASSERT(a.held_stride == h.stride && a.w_off == h.w_off,
                 "hier_combine: held_stride and w_off must be those of HierHeldRow(hidden, topk, fp8)");
  DC_HOST_ASSERT(a.hidden % 8 == 0 && reinterpret_cast<uintptr_t>(a.own_x) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(a.own_w) % 4 == 0,
                 "hier_combine: own_x must be 16-byte aligned bf16 rows (hidden % 8 == 0), own_w fp32 rows");
  DC_HOST_ASSERT(a.partial_stride % 16 == 0 && a.partial_stride >= 4 * (int64_t(a.hidden) + a.topk),
                 "hier_combine: partial_stride % 16 and >= 4 * (hidden + topk)");
  for (int m = 0; m < t.num_nodes; ++m)
    DC_HOST_ASSERT(a.rows_from[m] >= 0 && a.rows_from[m] <= a.max_rows, "hier_combine: rows_from in [0, max_rows]");
  DC_HOST_ASSERT(a.nvl.words_at < 0 || a.rdma.header_bytes >= uint32_t(t.gpus * kRailHeaderBytes),
                 "hier_combine: with words_at the header holds every node GPU's words (header_bytes >= gpus * 64)");
  hier_combine_kernel<<<blocks, kHierThreads, 0, stream>>>(a, keys, ctx);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
