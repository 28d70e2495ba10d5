// The internode normal kernels: hierarchical dispatch and combine, each one launch (docs/internode.md).
//
// Ranks R = N nodes x G GPUs; rank r is GPU r % G of node r / G. Between nodes bytes travel only between ranks
// of the same local index (the "rail"), as GPU-posted mlx5 WQEs (the exchange round of internode_round.hpp:
// credit, writes, signal) executed by the device emulated NIC (blocks of the same grid) or a ConnectX; inside a
// node rows move over NVLink peer pointers. The dispatch kernel builds each row from the caller's tensors and
// splits the received rows into the output tensors (runtime/hier_rows.hpp: HierDispatchRow); the combine kernel
// builds the held rows from the expert outputs (HierHeldRow), and decodes and sums them.
//
// Grid: rdma_blocks | nvl_blocks | one poster block (one thread per rail peer) | num_peers * nic_blocks NIC
// blocks (only with emulate_nic; queue j's at j * nic_blocks.., its leader first). Every block must be resident
// at once (they wait on each other, bounded by WaitCtx).
//
// The NVLink hop's words (NodeLink, deepcomm/internode/node_link.py), per node GPU g, u64 [G] each:
//   free[i]:   the last epoch node GPU i declared its area readable-and-done (it raises it at the start of a
//              launch: everything its stream read from its area before is finished); a writer into GPU i's
//              area waits for our free[i] >= epoch.
//   arrive[i]: the last epoch node GPU i finished writing into our area (raised after a system fence); a reader
//              of its own area waits for arrive[i] >= epoch for every i.
// Epochs are 1, 2, ... the same on every GPU of the node (shared with the node barrier's sequence).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../runtime/error_record.cuh"
#include "../runtime/host_device.hpp"
#include "../runtime/internode_layout.hpp"
#include "../runtime/hier_rows.hpp"
#include "../runtime/internode_limits.hpp"
#include "../transport/key_table.hpp"
#include "internode_exchange.hpp"
#include "node_barrier.hpp"

namespace dc {

constexpr int kHierMaxNodes = kInternodeMaxNodes;  // per-node arrays below: rows_to, rows_from
constexpr int kHierThreads = 512;
// With NVSHMEM device puts (deepcomm._nvshmem_kernels) every rail block travels as this many put-with-signal
// chunks (empty ones as a lone signal), each adding 1 to the receiver's signal word: a round r has landed when
// the word reaches r * kNvshmemChunks (the host API's count round SETs exactly that value).
constexpr int kNvshmemChunks = 8;

struct HierTopo {
  int num_nodes, gpus, node, local, rank;  // rank = node * gpus + local
};

// The RDMA hop of one launch (NicTransport's memory and queue pairs).
struct HierRdma {
  const InternodePeer* peers;  // device [num_peers]: the rail rank of every other node, nodes ascending (ours
                               // skipped); the kernel decides send_bytes (the field is ignored) and send_addr is
                               // the section's start
  int num_peers;               // num_nodes - 1
  uint32_t lkey;
  uint64_t round;              // the exchange round of this launch (one per launch, same on every rank)
  uint32_t chunk_bytes, log_wqebbs, log_cqes;
  uint8_t* send;               // our send area: the section for rail rank d at send + d * slot_bytes (ours: the
                               // section at our own rank, never posted: our own node's rows)
  const uint8_t* recv;         // our receive area: the block rail rank s sent us at recv + s * slot_bytes
  const uint64_t* signal;      // our signal[R]: signal[s] >= signal_target when s's block of this round has landed
  uint64_t signal_target;      // round (emulated NIC: one fetch-add per round) or round * kNvshmemChunks
  uint64_t* credit;            // our credit[R] (NVSHMEM device puts only; the emulated poster reads the peer table)
  bool nvshmem_puts;           // the poster issues NVSHMEM device puts (only the kernels of deepcomm._nvshmem_kernels)
  uint64_t slot_bytes;
  uint32_t header_bytes;       // % 16 == 0: bytes at the front of every section and slot, before the rows: the
                               // call's fingerprint words (deepcomm/agreement.py), written by the host into our
                               // sections before the launch, sent with the rows, read by the host after it
  bool emulate_nic;            // launch NIC blocks for the queue pairs
  int nic_blocks;              // NIC blocks per queue pair (emulate_nic), in [1, transport::kNicMaxBlocks]
};

// The NVLink hop: node GPU g's area and words as mapped here (ours at `local`).
struct HierNode {
  uint8_t* area[kMaxNodeGpus];
  uint64_t* free_words[kMaxNodeGpus];    // GPU g's free[G]; we store [local]
  uint64_t* arrive_words[kMaxNodeGpus];  // GPU g's arrive[G]; we store [local]
  uint64_t epoch;
  // Byte offset (% 16 == 0) in every node GPU's area of the words strip, or -1 (no words carried: one GPU per
  // node, or no fingerprint). The strip holds one kRailHeaderBytes header per rank, rail-major: rank s's words at
  // words_slot(s) (below). With it a launch ends with every rank's words in our strip (hier_agree.py).
  int64_t words_at;
};

// The strip slot of rank s = node m, GPU l (runtime/internode_layout.hpp WordsStrip).
DC_HD int words_slot(const HierTopo& t, int m, int l) { return WordsStrip(t.num_nodes, t.gpus, 0).slot(m, l); }

// ---------------------------------------------------------------------------------------------------- dispatch
// rdma blocks: build each token's row (`row`: x, scales, top-k ids, its own index, weights from `src`, and
//   masks[t][m] (int32) at mask_off when G > 1) in the send section of every node m that needs it
//   (rdma_slot[t][m] >= 0, the row index there; our own node too); then count themselves done (counters[0]).
// poster: per rail peer, once every rdma block is done: the exchange round with rows_to[m] * stride bytes.
// nvl blocks: for every rail source m (its section when it is our node, else its block in recv once signal
//   says it landed) forward row i to each node GPU g in its mask (G == 1: every row to us) at row
//   first_row[m][g] + (rank of row i among source m's rows for g) of g's area, after g freed it; write
//   route[m][i][g] = that rank or -1, and route[m][i][G] = the row's place in the combine's RDMA block
//   (exactly one node GPU holds it: k >= 0, its rank among such rows; several: -(rank among those) - 1);
//   singles[m] = how many rows of source m one node GPU holds. With words_at >= 0, nvl block 0 also puts the
//   header of every rail source's block (ours: our own section's) into slot words_slot(m, local) of every node
//   GPU's strip. Then arrive (the last nvl block, after a system fence, at every node GPU) and wait for every
//   node GPU's arrive and every rail peer's signal: our area then holds every row for us, source rank then token
//   order, every rail peer's block (its header included) has landed in recv, and (words_at) every rank's words
//   are in our strip. Last, nvl block b splits rows [b * num_recv / nvl_blocks, (b + 1) * ...) of our area into
//   `out` (row i of every part is received row i): nothing is left for the host to copy out of the area, which
//   the next launch reuses.
struct HierDispatchArgs {
  HierTopo topo;
  HierRdma rdma;
  HierNode nvl;
  HierDispatchRow row;         // x_bytes % 16 == 0, scale_bytes % 4 == 0
  HierRowSrc src;              // x 16-byte aligned; the others 4-byte aligned
  uint32_t stride;             // row.stride (% 16 == 0)
  uint32_t mask_off;           // row.mask_off (% 4 == 0); only with G > 1
  int num_tokens;
  HierRecvDst out;             // x 16-byte aligned; the others 4-byte aligned
  int num_recv;                // rows our area holds at the end: every source's rows for us
  const int32_t* masks;        // [T][N] bit g: node m's GPU g holds an expert of token t (read only when G > 1)
  const int32_t* rdma_slot;    // [T][N]
  int rows_to[kHierMaxNodes];  // our tokens node m needs (rows of our section for m)
  int rows_from[kHierMaxNodes];  // rows the rail rank of node m sends us (ours: rows_to[node])
  const int32_t* first_row;    // [N][G]
  int32_t* route;              // out [N][max_rows][G + 1]
  int32_t* singles;            // out [N]
  int max_rows;                // >= every rows_from[m]
  uint32_t* counters;          // [4], zero at the launch's start (the launch before zeroed them)
  uint32_t* counters_next;     // [4], the next launch's: zeroed here at entry
  int rdma_blocks, nvl_blocks;
};

// ----------------------------------------------------------------------------------------------------- combine
// Held rows (HierHeldRow, held_stride bytes): a row this rank received in the dispatch, as its expert output:
// x at 0 (bf16 [H], or with fp8 e4m3 [H] then fp32 scales [H/128], quantized here), fp32 weights [K] at w_off (K
// may be 0). Held row j is built from own_x row j (and own_w row j).
// nvl blocks: raise free (block 0 at every node GPU), then build the held rows of each source s != rank
//   (gather[s] = {first row, rows, byte offset}) in the area of node GPU s % G, after it freed it; the last
//   nvl block raises arrive at every node GPU after a system fence.
// rdma blocks: wait for every node GPU's arrive; for each rail source m and row i < rows_from[m], sum in fp32
//   from +0, node GPUs ascending, the rows route[m][i][g] >= 0 names: the row at area_off[m][g] + route * held_stride
//   of our area, or for our own tokens held by us (m == node, g == local) own_x / own_w row own_begin + route
//   (bf16, never quantized); fp8 rows are dequantized with one fp32 multiply per element, never fused into
//   the add. Write the partial:
//     m == node: fp32 [H] then fp32 [K] at row i * partial_stride of our own section;
//     else at route[m][i][G] = k >= 0 (one holder): that holder's row bytes as held (held_stride bytes, exact)
//       at k * held_stride of the section for m; k < 0: the fp32 partial at
//       singles[m] * held_stride + (-k - 1) * partial_stride.
//   Count themselves done (counters[1]); then, once every rdma block is done and every rail peer's block
//   landed, sum per token t, nodes ascending, fp32 from +0, what node m sent for it (the dispatch's route,
//   runtime/hier_route_layout.hpp): nothing where rdma_slot[t][m] < 0; from our own node the fp32 partial at
//   rdma_slot[t][m] * partial_stride of our own section; else, in node m's block in recv, held_slot[t][m] = k >= 0
//   (one GPU holds it): the held row at k * held_stride, k < 0: the fp32 partial at one_held[m] * held_stride +
//   (-k - 1) * partial_stride. out_x = bf16 (round to nearest even), out_w fp32.
// poster: per rail peer m, once every rdma block is done: the exchange round with
//   singles[m] * held_stride + (rows_from[m] - singles[m]) * partial_stride bytes.
// Words (words_at >= 0; header_bytes is then G * kRailHeaderBytes): nvl block 0 puts our words (the front of our
//   own section, written by the host) into slot words_slot(node, local) of every node GPU's strip before arrive;
//   rdma block 0, once every node GPU arrived, copies our node's G slots (local index order) into the header of
//   every other node's section before it counts done, and once every rail peer's block landed, the G headers
//   node m sent into our slots words_slot(m, 0..G-1): the launch ends with every rank's words in our strip.
struct HierCombineArgs {
  HierTopo topo;
  HierRdma rdma;
  HierNode nvl;
  uint32_t held_stride, w_off; // HierHeldRow(hidden, topk, fp8).stride and .w_off
  int hidden, topk;
  bool fp8;                    // held x is e4m3 + scales (hidden % 128 == 0)
  const uint16_t* own_x;       // bf16 [real][hidden], 16-byte aligned: our rows (our own tokens' at own_begin..)
  const float* own_w;          // fp32 [real][topk]; null when topk == 0 or real == 0 (never read)
  int own_begin;
  const int64_t* gather;       // [R][3]
  const int32_t* route;        // [N][max_rows][G + 1], from the dispatch
  const int32_t* singles;      // [N], from the dispatch
  int max_rows;
  int rows_from[kHierMaxNodes];
  const int64_t* area_off;     // [N][G] byte offset in our area (unused for m == node, g == local)
  uint32_t partial_stride;     // round_up(4 * hidden + 4 * topk, 16)
  const int32_t* rdma_slot;    // [T][N], from the dispatch's route
  const int32_t* held_slot;    // [T][N] (G == 1: rdma_slot itself, every k >= 0)
  const int32_t* one_held;     // [N]; never read with G == 1 (may be null)
  int num_tokens;
  uint16_t* out_x;             // bf16 [T][hidden]
  float* out_w;                // fp32 [T][topk] or null
  uint32_t* counters;          // [4], zero at the launch's start (the launch before zeroed them)
  uint32_t* counters_next;     // [4], the next launch's: zeroed here at entry
  int rdma_blocks, nvl_blocks;
};

// Launch on `stream`; the grid must fit the device (every block resident), checked on the host.
void launch_hier_dispatch(const HierDispatchArgs& args, const transport::KeyTable& keys, const WaitCtx& ctx,
                          cudaStream_t stream);
void launch_hier_combine(const HierCombineArgs& args, const transport::KeyTable& keys, const WaitCtx& ctx,
                         cudaStream_t stream);

}  // namespace dc
