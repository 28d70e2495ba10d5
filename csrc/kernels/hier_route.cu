// The route of a fresh internode dispatch and its count-round row (contract in hier_route.hpp).
#include <cuda_runtime.h>

#include "../runtime/cuda_check.hpp"
#include "../runtime/hier_route_layout.hpp"
#include "../runtime/internode_limits.hpp"
#include "hier_route.hpp"
#include "topk_max.hpp"

namespace dc {
namespace {

constexpr int kThreads = kHierRouteThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kPer = kHierRouteTokensPerThread;  // consecutive tokens per thread
constexpr int64_t kTile = int64_t(kThreads) * kPer;

// A rank block's ranks: whole nodes, at most 32 (one bit each).
__host__ __device__ inline int ranks_per_block(int gpus) { return gpus * (32 / gpus); }

// One block-wide prefix sum of up to 32 bit columns over the tokens, tile by tile.
struct ColumnScan {
  int warp_total[kWarps][33];  // per warp and column: the warp's inclusive total, then its exclusive start
  int base[32];                // per column: its set bits in the tiles before
};

// bits[i]: the columns of the thread's i-th token of the tile (tokens in order: thread 0's kPer, then thread 1's).
// start[j]: how many tokens before the thread's first one, in this tile and the ones before, have bit j. The
// scan's base then counts this tile too. Every thread of the block calls it.
__device__ void scan_columns(const uint32_t (&bits)[kPer], int ncols, ColumnScan& s, int (&start)[32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    int c = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) c += int((bits[i] >> j) & 1u);
    int v = c;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d) v += u;
    }
    start[j] = v - c;
    if (lane == 31) s.warp_total[warp][j] = v;
  }
  __syncthreads();
  for (int j = warp; j < ncols; j += kWarps) {  // a warp per column: where each warp's tokens start
    const int t = lane < kWarps ? s.warp_total[lane][j] : 0;
    int v = t;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, v, d);
      if (lane >= d) v += u;
    }
    const int base = s.base[j];
    __syncwarp();
    if (lane < kWarps) s.warp_total[lane][j] = base + v - t;
    if (lane == 31) s.base[j] = base + v;  // lanes past the warps add nothing: lane 31 holds the tile's total
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < 32; ++j) start[j] += s.warp_total[warp][j];
  __syncthreads();  // every thread has its starts before the next tile writes the totals
}

__device__ void rank_block(const HierRouteArgs& a, const HierRouteWork& w, int block) {
  __shared__ ColumnScan rank_scan, node_scan, one_scan;
  const int R = a.ranks, G = a.gpus;
  const int per_block = ranks_per_block(G);
  const int r0 = block * per_block;
  const int nr = min(per_block, R - r0);
  const int N = R / G, n0 = r0 / G, nn = G > 1 ? nr / G : 0;
  const int64_t T = a.num_tokens, L = a.num_experts / R;
  const uint32_t gpu_bits = G >= 32 ? 0xffffffffu : (1u << G) - 1u;
  if (threadIdx.x < 32) rank_scan.base[threadIdx.x] = node_scan.base[threadIdx.x] = one_scan.base[threadIdx.x] = 0;
  int* send_pos = a.work + w.send_pos;
  uint8_t* in_rank = reinterpret_cast<uint8_t*>(a.work + w.in_rank);
  for (int64_t tile = 0; tile < T; tile += kTile) {
    const int64_t first = tile + int64_t(threadIdx.x) * kPer;
    uint32_t bits[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      bits[i] = 0;
      const int64_t t = first + i;
      if (t >= T) continue;
      const int64_t* ids = a.topk_idx + t * a.topk;
      for (int k = 0; k < a.topk; ++k) {
        const int64_t e = __ldg(ids + k);
        if (e < 0 || e >= a.num_experts) continue;  // -1, or a bad id: counts nowhere (the expert blocks count it)
        const int r = int(e / L) - r0;
        if (r >= 0 && r < nr) bits[i] |= 1u << r;
      }
    }
    int start[32];
    scan_columns(bits, nr, rank_scan, start);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t t = first + i;
      if (t >= T) break;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        if (j < nr) {
          const bool in = (bits[i] >> j) & 1u;
          send_pos[t * R + r0 + j] = in ? start[j]++ : -1;
          in_rank[t * R + r0 + j] = in;
        }
      }
    }
    if (G == 1) continue;  // a node is a rank: the rdma slots are the send positions
    // per node of the block: held by some GPU of it (node_bits), by exactly one (one_bits)
    uint32_t node_bits[kPer], one_bits[kPer];
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      node_bits[i] = one_bits[i] = 0;
      for (int m = 0; m < nn; ++m) {
        const uint32_t g = (bits[i] >> (m * G)) & gpu_bits;
        if (g) node_bits[i] |= 1u << m;
        if (g && !(g & (g - 1u))) one_bits[i] |= 1u << m;
      }
    }
    scan_columns(node_bits, nn, node_scan, start);
    int ones[32];
    scan_columns(one_bits, nn, one_scan, ones);
    int* rdma_slot = a.work + w.rdma_slot;
    int* masks = a.work + w.masks;
    int* held_slot = a.work + w.held_slot;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t t = first + i;
      if (t >= T) break;
#pragma unroll
      for (int m = 0; m < 16; ++m) {  // G > 1: at most 16 nodes per block
        if (m < nn) {
          const bool in = (node_bits[i] >> m) & 1u, one = (one_bits[i] >> m) & 1u;
          // held slot: the token's index among those its node holds on one GPU, or -(its index among those it
          // holds on several) - 1: its rdma slot less the single-held tokens before it
          held_slot[t * N + n0 + m] = one ? ones[m] : in ? -(start[m] - ones[m]) - 1 : -1;
          rdma_slot[t * N + n0 + m] = in ? start[m]++ : -1;
          masks[t * N + n0 + m] = int((bits[i] >> (m * G)) & gpu_bits);
          ones[m] += one;
        }
      }
    }
  }
  __syncthreads();  // T == 0: the bases' zeros; else the last scan's totals
  int* row = a.work + w.row;
  if (threadIdx.x < nr) row[w.count_row.ranks + r0 + threadIdx.x] = rank_scan.base[threadIdx.x];
  if (threadIdx.x < nn) {
    row[w.count_row.nodes + n0 + threadIdx.x] = node_scan.base[threadIdx.x];
    a.work[w.one_held + n0 + threadIdx.x] = one_scan.base[threadIdx.x];
  }
}

__device__ void expert_block(const HierRouteArgs& a, const HierRouteWork& w, int block) {
  __shared__ int hist[kHierRouteExperts];
  __shared__ int bad;
  const int64_t e0 = int64_t(block) * kHierRouteExperts;
  const int64_t left = a.num_experts - e0;
  const int ne = left < kHierRouteExperts ? int(left) : kHierRouteExperts;
  const bool counts_bad = block == 0;
  for (int i = threadIdx.x; i < ne; i += kThreads) hist[i] = 0;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  int my_bad = 0;
  for (int64_t t = threadIdx.x; t < a.num_tokens; t += kThreads) {
    const int64_t* ids = a.topk_idx + t * a.topk;
    for (int k = 0; k < a.topk; ++k) {
      const int64_t e = __ldg(ids + k);
      if (counts_bad && (e < -1 || e >= a.num_experts)) ++my_bad;
      if (e < e0 || e >= e0 + ne) continue;
      bool seen = false;  // an expert a token names twice counts once
      for (int q = 0; q < k && !seen; ++q) seen = __ldg(ids + q) == e;
      if (!seen) atomicAdd(&hist[e - e0], 1);
    }
  }
  if (my_bad) atomicAdd(&bad, my_bad);
  __syncthreads();
  int* row = a.work + w.row;
  for (int i = threadIdx.x; i < ne; i += kThreads) row[w.count_row.experts + e0 + i] = hist[i];
  if (!counts_bad) return;
  if (a.with_words && threadIdx.x < kFingerprintWords) row[w.count_row.words + threadIdx.x] = a.words.w[threadIdx.x];
  if (threadIdx.x == 0) row[w.count_row.bad] = bad;
  for (int64_t i = w.count_row.bad + 1 + threadIdx.x; i < w.count_row.width; i += kThreads) row[i] = 0;
}

__global__ void __launch_bounds__(kThreads) hier_route_kernel(HierRouteArgs a, int rank_blocks) {
  const HierRouteWork w(a.num_tokens, a.ranks, a.gpus, a.num_experts, a.with_words);
  if (int(blockIdx.x) < rank_blocks)
    rank_block(a, w, int(blockIdx.x));
  else
    expert_block(a, w, int(blockIdx.x) - rank_blocks);
}

}  // namespace

void launch_hier_route(const HierRouteArgs& a, cudaStream_t stream) {
  DC_HOST_ASSERT(a.ranks >= 1 && a.ranks <= kInternodeMaxRanks && a.gpus >= 1 && a.gpus <= 32 &&
                     a.ranks % a.gpus == 0,
                 "hier_route: ranks must be a multiple of gpus, at most INTERNODE_MAX_RANKS");
  DC_HOST_ASSERT(a.num_experts >= a.ranks && a.num_experts % a.ranks == 0 && a.num_experts < (int64_t(1) << 31),
                 "hier_route: num_experts must be a positive multiple of ranks");
  DC_HOST_ASSERT(a.topk >= 0 && a.topk <= kTopkMax, "hier_route: topk out of range");
  DC_HOST_ASSERT(a.num_tokens >= 0 && (a.num_tokens == 0 || a.topk == 0 || a.topk_idx != nullptr) &&
                     a.work != nullptr && reinterpret_cast<uintptr_t>(a.work) % 16 == 0,
                 "hier_route: needs the ids and a 16-byte aligned workspace");
  const int per_block = ranks_per_block(a.gpus);
  const int rank_blocks = (a.ranks + per_block - 1) / per_block;
  const int expert_blocks = int((a.num_experts + kHierRouteExperts - 1) / kHierRouteExperts);
  hier_route_kernel<<<rank_blocks + expert_blocks, kThreads, 0, stream>>>(a, rank_blocks);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
