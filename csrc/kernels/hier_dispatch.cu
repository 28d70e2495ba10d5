// The hierarchical internode dispatch, one launch (contract in hier_kernels.hpp; shared roles in hier_roles.cuh).
//   pack blocks:    our tokens' rows, built from the caller's tensors, into the send section of every node that
//                   needs them (ours too: the self section), with the node's GPU mask at mask_off when G > 1;
//                   then counters[0] += 1.
//   forward blocks: free our area, then per rail source (our own node first) forward each row to the node GPUs
//                   its mask names, at the row the reference order gives it; route / singles for the combine;
//                   block 0 puts every rail source's words into every node GPU's strip (words_at >= 0); the last
//                   one raises arrive at every node GPU; block 0 waits for every node GPU's arrive and for every
//                   rail peer's block (the host reads the words: the headers, or the strip); then every forward
//                   block splits its share of the rows in our area into the output tensors.
//   poster block:   the exchange round with every rail peer once every pack block is done.
//   NIC blocks:     nic_blocks per queue pair (emulated NIC only), the first of each its leader.
#include <cuda_runtime.h>

#include <string>

#include "../runtime/cuda_check.hpp"
#include "hier_kernels.hpp"
#include "hier_roles.cuh"
#include "warp_copy.cuh"

namespace dc {

namespace {

using namespace hier;

constexpr int kWarps = kHierThreads / 32;
constexpr uint32_t kFull = 0xffffffffu;

__device__ __forceinline__ uint32_t gpu_bits(int G) { return G >= 32 ? kFull : (1u << G) - 1u; }

// The mask word of a row written during this launch (our pack blocks, or the peer's NIC), already ordered by an
// acquire; only bits of existing node GPUs count.
__device__ __forceinline__ uint32_t row_mask(const uint8_t* row, uint32_t mask_off, uint32_t bits) {
  return ptx::ld_relaxed_gpu_u32(reinterpret_cast<const uint32_t*>(row + mask_off)) & bits;
}

// Lane `lane` of a warp builds 16-byte vectors [x16 + lane, n16) step 32 of token `tok`'s row (the words past the
// leading x vectors: runtime/hier_rows.hpp) with node GPU mask `mask`, into `dst`.
__device__ __forceinline__ void store_row_tail(const HierDispatchArgs& a, int tok, uint32_t mask, uint8_t* dst,
                                               int64_t x16, int64_t n16, int lane) {
  for (int64_t v = x16 + lane; v < n16; v += 32) {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = dispatch_row_word(a.row, a.src, tok, 16 * v + 4 * j, mask);
    ptx::st_na_v4(reinterpret_cast<int4*>(dst) + v, make_int4(int(w[0]), int(w[1]), int(w[2]), int(w[3])));
  }
}

__device__ __forceinline__ void pack_block(const HierDispatchArgs& a, int b) {
  const HierTopo& t = a.topo;
  const int N = t.num_nodes, warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int begin = int(int64_t(b) * a.num_tokens / a.rdma_blocks);
  const int end = int(int64_t(b + 1) * a.num_tokens / a.rdma_blocks);
  const int64_t n16 = a.stride / 16, x16 = a.row.x_bytes / 16;
  for (int tok = begin + warp; tok < end; tok += kWarps) {
    // Lane m holds node m's slot (and mask): one load each for the whole warp.
    const int32_t slot = lane < N ? a.rdma_slot[int64_t(tok) * N + lane] : -1;
    const int32_t mask = (lane < N && t.gpus > 1) ? a.masks[int64_t(tok) * N + lane] : 0;
    const auto* x = reinterpret_cast<const int4*>(a.src.x + int64_t(tok) * a.row.x_bytes);
    for (uint32_t need = __ballot_sync(kFull, slot >= 0); need != 0; need &= need - 1) {
      const int m = __ffs(need) - 1;
      const int32_t s = __shfl_sync(kFull, slot, m);
      const int32_t mk = __shfl_sync(kFull, mask, m);
      uint8_t* dst = a.rdma.send + int64_t(rail_rank(t, m)) * a.rdma.slot_bytes + a.rdma.header_bytes +
                     int64_t(s) * a.stride;
      warp_copy_v4<4>(x, reinterpret_cast<int4*>(dst), x16, lane);  // the caller's x: never written in the launch
      store_row_tail(a, tok, uint32_t(mk), dst, x16, n16, lane);
    }
  }
  block_done(&a.counters[0]);
}

// Forward rows [begin, end) of rail source m (n rows at `src`) to the node GPUs, writing their route entries.
// Returns false after a failed wait (the caller returns at once).
__device__ __forceinline__ bool forward_source(const HierDispatchArgs& a, int m, int b, const WaitCtx& ctx) {
  const HierTopo& t = a.topo;
  const int G = t.gpus, warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int n = a.rows_from[m], nb = a.nvl_blocks;
  const int begin = int(int64_t(b) * n / nb), end = int(int64_t(b + 1) * n / nb);
  const bool last = b == nb - 1;  // its range ends at n: it knows the source's singles
  const int64_t n16 = a.stride / 16;
  int32_t* route = a.route + int64_t(m) * a.max_rows * (G + 1);

  __shared__ uint8_t* s_dst[kMaxNodeGpus];  // node GPU g's first row for this source in its area
  __shared__ int s_before[kMaxNodeGpus + 1];  // rows of [0, begin) for g; [G]: single-holder rows of [0, begin)

  __syncthreads();  // every warp is done with the previous source's shared state
  if (begin == end) {
    if (last && threadIdx.x == 0) a.singles[m] = 0;  // n == 0 (the last range is empty only then)
    return true;
  }
  const uint8_t* src;
  bool ok;
  if (m == t.node) {
    src = a.rdma.send + int64_t(t.rank) * a.rdma.slot_bytes + a.rdma.header_bytes;
    ok = block_wait_count(&a.counters[0], uint32_t(a.rdma_blocks), ctx);
  } else {
    src = a.rdma.recv + int64_t(rail_rank(t, m)) * a.rdma.slot_bytes + a.rdma.header_bytes;
    ok = block_wait_signal(a.rdma, rail_rank(t, m), ctx);
  }
  if (!ok) return false;
  if (int(threadIdx.x) < G)
    s_dst[threadIdx.x] = a.nvl.area[threadIdx.x] + int64_t(a.first_row[m * G + threadIdx.x]) * a.stride;
  if (int(threadIdx.x) <= G) s_before[threadIdx.x] = 0;
  __syncthreads();

  if (G == 1) {  // every row to us, in order; each row has exactly one holder
    for (int i = begin + warp; i < end; i += kWarps) {
      warp_copy_fresh(reinterpret_cast<const int4*>(src + int64_t(i) * a.stride),
                      reinterpret_cast<int4*>(s_dst[0] + int64_t(i) * a.stride), n16, lane);
      if (lane == 0) route[2 * int64_t(i)] = route[2 * int64_t(i) + 1] = i;
    }
    if (last && threadIdx.x == 0) a.singles[m] = n;
    return true;
  }

  // Ranks need the counts over the rows before our range: every warp takes 32-row chunks of [0, begin).
  const uint32_t bits = gpu_bits(G), lt = ptx::lanemask_lt();
  {
    int mine = 0, single = 0;  // lane g < G: rows for g; single: the same in every lane
    for (int i0 = warp * 32; i0 < begin; i0 += kWarps * 32) {
      const int i = i0 + lane;
      const uint32_t mk = i < begin ? row_mask(src + int64_t(i) * a.stride, a.mask_off, bits) : 0u;
      for (int g = 0; g < G; ++g) {
        const int c = __popc(__ballot_sync(kFull, (mk >> g) & 1u));
        if (lane == g) mine += c;
      }
      single += __popc(__ballot_sync(kFull, __popc(mk) == 1));
    }
    if (lane < G && mine != 0) atomicAdd(&s_before[lane], mine);
    if (lane == 0 && single != 0) atomicAdd(&s_before[G], single);
  }
  __syncthreads();

  // Warp 0 walks our range in order and writes every row's route (read back by the copying warps below).
  if (warp == 0) {
    int base = lane < G ? s_before[lane] : 0;  // lane g: the next rank for g
    int singles = s_before[G], multis = begin - singles;
    for (int i0 = begin; i0 < end; i0 += 32) {
      const int i = i0 + lane;
      const bool valid = i < end;
      const uint32_t mk = valid ? row_mask(src + int64_t(i) * a.stride, a.mask_off, bits) : 0u;
      int32_t* r = route + int64_t(i) * (G + 1);
      for (int g = 0; g < G; ++g) {
        const bool has = (mk >> g) & 1u;
        const uint32_t set = __ballot_sync(kFull, has);
        const int at = __shfl_sync(kFull, base, g);
        if (valid) r[g] = has ? at + __popc(set & lt) : -1;
        if (lane == g) base += __popc(set);
      }
      // A row with one holder travels back as that holder's row, else as an fp32 partial (a mask of 0 too).
      const bool one = __popc(mk) == 1;
      const uint32_t ones = __ballot_sync(kFull, valid && one), several = __ballot_sync(kFull, valid && !one);
      if (valid) r[G] = one ? singles + __popc(ones & lt) : -(multis + __popc(several & lt)) - 1;
      singles += __popc(ones);
      multis += __popc(several);
    }
    if (last && lane == 0) a.singles[m] = singles;
  }
  __syncthreads();  // route of our range written (global stores of this block, ordered by the barrier)

  for (int i = begin + warp; i < end; i += kWarps) {
    const uint8_t* row = src + int64_t(i) * a.stride;
    const int32_t* r = route + int64_t(i) * (G + 1);
    for (uint32_t mk = row_mask(row, a.mask_off, bits); mk != 0; mk &= mk - 1) {
      const int g = __ffs(mk) - 1;
      warp_copy_fresh(reinterpret_cast<const int4*>(row),
                      reinterpret_cast<int4*>(s_dst[g] + int64_t(r[g]) * a.stride), n16, lane);
    }
  }
  return true;
}

// Forward block b, once every node GPU's arrive says our area is complete: rows [b * n / nb, (b + 1) * n / nb) of
// our area (n = num_recv) into the output tensors, one warp per row (x as 16-byte vectors, the rest word by word,
// the top-k slots of a fresh dispatch a lane each, as local ids and masked weights: runtime/hier_rows.hpp). The rows
// were written during the launch by node GPUs: coherent loads.
__device__ __forceinline__ void unpack_received(const HierDispatchArgs& a, int b, const WaitCtx& ctx) {
  const HierTopo& t = a.topo;
  for (int g = 0; g < t.gpus; ++g)
    if (!block_wait_node_word(a.nvl.arrive_words[t.local], g, a.nvl.epoch, t, ctx, kStageHierArrive)) return;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, nb = a.nvl_blocks;
  const int begin = int(int64_t(b) * a.num_recv / nb), end = int(int64_t(b + 1) * a.num_recv / nb);
  const int64_t n16 = a.stride / 16, x16 = a.row.x_bytes / 16;
  const uint8_t* area = a.nvl.area[t.local];
  for (int i = begin + warp; i < end; i += kWarps) {
    const auto* row = reinterpret_cast<const int4*>(area + int64_t(i) * a.stride);
    warp_copy_fresh(row, reinterpret_cast<int4*>(a.out.x + int64_t(i) * a.row.x_bytes), x16, lane);
    for (int64_t v = x16 + lane; v < n16; v += 32) {
      const int4 q = ptx::ld_relaxed_gpu_v4(row + v);
      const uint32_t w[4] = {uint32_t(q.x), uint32_t(q.y), uint32_t(q.z), uint32_t(q.w)};
#pragma unroll
      for (int j = 0; j < 4; ++j) dispatch_unpack_word(a.row, a.out, i, 16 * v + 4 * j, w[j]);
    }
    if (dispatch_unpacks_slots(a.row, a.out) && lane < a.row.topk) {  // topk <= 32: a lane per slot
      const auto* at = reinterpret_cast<const uint8_t*>(row);
      const auto* id = reinterpret_cast<const uint32_t*>(at + a.row.idx_off + 8 * lane);
      const uint32_t weight =
          a.row.w_off >= 0 ? ptx::ld_relaxed_gpu_u32(reinterpret_cast<const uint32_t*>(at + a.row.w_off) + lane) : 0u;
      dispatch_unpack_slot(a.row, a.out, i, lane, ptx::ld_relaxed_gpu_u32(id), ptx::ld_relaxed_gpu_u32(id + 1), weight);
    }
  }
}

__device__ __forceinline__ void forward_block(const HierDispatchArgs& a, int b, const WaitCtx& ctx) {
  const HierTopo& t = a.topo;
  const uint64_t epoch = a.nvl.epoch;
  // Our area is free for this launch (the stream's earlier reads of it are done); others wait for it.
  if (b == 0) raise_node_words(a.nvl.free_words, t, epoch);
  for (int g = 0; g < t.gpus; ++g)
    if (!block_wait_node_word(a.nvl.free_words[t.local], g, epoch, t, ctx, kStageHierFree)) return;

  // Our own node first: its rows need no network.
  for (int j = 0; j < t.num_nodes; ++j)
    if (!forward_source(a, (t.node + j) % t.num_nodes, b, ctx)) return;

  // The words of every rail source (ours: the front of our own section) into slot words_slot(m, local) of every
  // node GPU's strip, so every rank's words reach every rank; arrive orders them as it orders the rows.
  if (b == 0 && a.nvl.words_at >= 0) {
    const int N = t.num_nodes;
    for (int m = 0; m < N; ++m)
      if (m != t.node && !block_wait_signal(a.rdma, rail_rank(t, m), ctx)) return;
    copy_headers(
        N * t.gpus,
        [&](int i) -> const uint8_t* {
          const int m = i % N;
          return (m == t.node ? a.rdma.send : a.rdma.recv) + int64_t(rail_rank(t, m)) * a.rdma.slot_bytes;
        },
        [&](int i) -> uint8_t* {
          return a.nvl.area[i / N] + a.nvl.words_at + int64_t(words_slot(t, i % N, t.local)) * kRailHeaderBytes;
        });
  }

  // Every forward block's rows are visible at system scope before the last one raises arrive.
  const uint32_t before = block_done(&a.counters[1]);
  if (before == uint32_t(a.nvl_blocks - 1)) raise_node_words(a.nvl.arrive_words, t, epoch);
  if (b == 0) {  // after our own block_done: never waits on itself
    for (int g = 0; g < t.gpus; ++g)
      if (!block_wait_node_word(a.nvl.arrive_words[t.local], g, epoch, t, ctx, kStageHierArrive)) return;
    // Every rail peer's block has landed before the kernel ends, rows for us or not (a source without rows is
    // never waited for above): the host reads the header at its front, the call's fingerprint, after the launch.
    for (int m = 0; m < t.num_nodes; ++m)
      if (m != t.node && !block_wait_signal(a.rdma, rail_rank(t, m), ctx)) return;
  }
  unpack_received(a, b, ctx);
}

__global__ void __launch_bounds__(kHierThreads) hier_dispatch_kernel(HierDispatchArgs a, KeyTable keys,
                                                                     WaitCtx ctx_in) {
  const WaitCtx& ctx = ctx_in;  // its seq is the launch's round (hier_launch.hpp)
  zero_next_counters(a.counters_next);
  const int blk = int(blockIdx.x);
  const int poster = a.rdma_blocks + a.nvl_blocks;
  if (blk < a.rdma_blocks) {
    pack_block(a, blk);
  } else if (blk < poster) {
    forward_block(a, blk - a.rdma_blocks, ctx);
  } else if (blk == poster) {
    poster_block(
        a.rdma, a.topo, &a.counters[0], uint32_t(a.rdma_blocks),
        [&](int j) { return uint64_t(a.rows_to[peer_node(a.topo, j)]) * a.stride; }, ctx);
  } else {
    nic_block(a.rdma, blk - poster - 1, keys, ctx);
  }
}

}  // namespace

static_assert(sizeof(HierDispatchArgs) + sizeof(KeyTable) + sizeof(WaitCtx) < 4000,
              "hier_dispatch: kernel parameters must fit the 4 KB parameter space");

void launch_hier_dispatch(const HierDispatchArgs& args, const transport::KeyTable& keys, const WaitCtx& ctx,
                          cudaStream_t stream) {
  const HierTopo& t = args.topo;
  const int N = t.num_nodes, G = t.gpus;
  const int blocks = checked_grid_blocks(t, args.rdma, args.rdma_blocks, args.nvl_blocks, "hier_dispatch");
  DC_HOST_ASSERT(args.stride >= 16 && args.stride % 16 == 0, "hier_dispatch: stride must be a multiple of 16");
  DC_HOST_ASSERT(G == 1 || (args.mask_off % 4 == 0 && uint64_t(args.mask_off) + 4 <= args.stride),
                 "hier_dispatch: mask_off must be 4-byte aligned and inside the row");
  DC_HOST_ASSERT(args.num_tokens >= 0, "hier_dispatch: num_tokens must be >= 0");
  const HierDispatchRow& row = args.row;
  DC_HOST_ASSERT(row.x_bytes >= 16 && row.x_bytes % 16 == 0 && row.scale_bytes % 4 == 0 &&
                     args.stride == row.stride && (G == 1 || args.mask_off == row.mask_off),
                 "hier_dispatch: x rows must be a multiple of 16 bytes, scale rows of 4, stride and mask_off those "
                 "of the row");
  const auto aligned = [](const void* p, uintptr_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; };
  DC_HOST_ASSERT(aligned(args.src.x, 16) && aligned(args.out.x, 16) && aligned(args.src.scales, 4) &&
                     aligned(args.out.scales, 4) && aligned(args.src.topk_idx, 4) && aligned(args.out.topk_idx, 4) &&
                     aligned(args.src.weights, 4) && aligned(args.out.weights, 4) && aligned(args.out.src_idx, 4),
                 "hier_dispatch: x and out.x must be 16-byte aligned, the other parts 4-byte aligned");
  DC_HOST_ASSERT((args.num_tokens == 0 || args.src.x != nullptr) && (args.num_recv == 0 || args.out.x != nullptr) &&
                     (row.scale_off < 0 || ((args.num_tokens == 0 || args.src.scales != nullptr) &&
                                            (args.num_recv == 0 || args.out.scales != nullptr))) &&
                     (row.idx_off < 0 || args.num_tokens == 0 || args.src.topk_idx != nullptr) &&
                     (row.w_off < 0 || args.num_tokens == 0 || args.src.weights != nullptr),
                 "hier_dispatch: a part of the row has no source or output");
  DC_HOST_ASSERT(args.num_recv >= 0, "hier_dispatch: num_recv must be >= 0");
  DC_HOST_ASSERT(args.rows_from[t.node] == args.rows_to[t.node],
                 "hier_dispatch: rows_from[node] must equal rows_to[node]");
  for (int m = 0; m < N; ++m) {
    DC_HOST_ASSERT(args.rows_from[m] >= 0 && args.rows_from[m] <= args.max_rows && args.rows_to[m] >= 0,
                   "hier_dispatch: rows of node " + std::to_string(m) + " outside [0, max_rows]");
    DC_HOST_ASSERT(uint64_t(args.rows_from[m]) * args.stride + args.rdma.header_bytes <= args.rdma.slot_bytes &&
                       uint64_t(args.rows_to[m]) * args.stride + args.rdma.header_bytes <= args.rdma.slot_bytes,
                   "hier_dispatch: rows of node " + std::to_string(m) + " do not fit slot_bytes");
  }
  hier_dispatch_kernel<<<blocks, kHierThreads, 0, stream>>>(args, keys, ctx);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
