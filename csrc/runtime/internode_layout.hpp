// The one description of the internode path's memory: the row sizes of its two hops and one rail receive slot,
// the NIC transport's registered region, NVSHMEM's symmetric block, and the NVLink hop's peer-mapped region. The
// host sizes and carves them with these (deepcomm/internode/internode_rows.py, nic_transport.py,
// nvshmem_transport.py, node_link.py read them through the extension's internode_rows, nic_region_layout,
// nvshmem_region_layout and node_link_layout); the kernels get the resulting pointers and sizes in their arguments
// (kernels/hier_kernels.hpp, internode_exchange.hpp), so nothing else computes these offsets.
#pragma once
#include <cstdint>

#include "../kernels/topk_max.hpp"
#include "agree_record.hpp"
#include "host_device.hpp"
#include "nvl_layout.hpp"

namespace dc {

// Bytes at the front of every rail block of a call's first RDMA exchange, and of every section the hierarchical
// kernels send: the call's fingerprint words (zeros where nothing is compared; deepcomm/internode/hier_agree.py).
constexpr int64_t kRailHeaderBytes = 4 * kFingerprintWords;
// With several GPUs per node a combine's rail header carries the words of every GPU of its node: up to this many
// headers, which every receive slot has room for.
constexpr int64_t kMaxNodeHeaders = 8;
static_assert(kRailHeaderBytes % 16 == 0, "hier_kernels.hpp: header_bytes % 16 == 0");

// Row sizes of the internode path for rows of `hidden` values (room for kTopkMax top-k slots):
//   node_row  widest row the NVLink hop carries: a dispatch row of bf16 x (FP8 values + scales are narrower),
//             int64 top-k ids, fp32 top-k weights, an int32 source index and an int32 node mask, padded to 16
//             bytes (combine rows, bf16 x + weights + source index, are narrower)
//   rail_row  widest row an RDMA exchange carries: node_row, or a combine partial of several rows (fp32 x and
//             fp32 weights)
//   slot      one receive slot of the RDMA hop, for either transport: a rail rank sends us at most one row per
//             token of its own (dispatch: each token once per node; combine: one partial per (token, node)), each
//             at most rail_row, after kMaxNodeHeaders headers, 64-byte aligned
struct InternodeRows {
  int64_t node_row, rail_row, slot;
  DC_HD InternodeRows(int64_t max_tokens, int64_t hidden) {
    node_row = align_up(2 * hidden + int64_t(kTopkMax) * 12 + 8, 16);
    const int64_t partial = align_up(4 * hidden + int64_t(kTopkMax) * 4, 16);
    rail_row = node_row > partial ? node_row : partial;
    slot = align_up(kMaxNodeHeaders * kRailHeaderBytes + max_tokens * rail_row, 64);
  }
};

// A rank's registered memory of the NIC transport (deepcomm/internode/nic_transport.py), 256-byte aligned parts:
//   signal u64 [R]           signal[s]: rounds whose block from s has landed here (raised by s's fetch-add)
//   credit u64 [R]           credit[s]: rounds for which s has freed its receive slot for us
//   fa_old u64 [R][2]        old values returned by our fetch-adds to peer s (kernels/internode_exchange.hpp)
//   send   bytes [R * slot]  our packed rows, grouped by destination
//   recv   bytes [R][slot]   recv[s]: the block rank s sent us this round
struct NicRegion {
  int64_t signal, credit, fa_old, send, recv, total;
  DC_HD NicRegion(int ranks, int64_t slot_bytes) {
    int64_t off = 0;
    signal = off; off = align_up(off + int64_t(ranks) * 8, kAlign);
    credit = off; off = align_up(off + int64_t(ranks) * 8, kAlign);
    fa_old = off; off = align_up(off + int64_t(ranks) * 16, kAlign);
    send = off;   off = align_up(off + int64_t(ranks) * slot_bytes, kAlign);
    recv = off;   off = align_up(off + int64_t(ranks) * slot_bytes, kAlign);
    total = off;
  }
};

// A rank's block of NVSHMEM's symmetric heap (deepcomm/internode/nvshmem_transport.py; the same offsets on every
// rank), 256-byte aligned parts:
//   signal u64 [R]           signal[s]: the last round whose block from s has landed here
//   credit u64 [R]           credit[s]: the last round for which s has freed its receive slot for us
//   send   bytes [R * slot]  our packed rows, grouped by destination
//   recv   bytes [R][slot]   recv[s]: the block rank s sent us this round
struct NvshmemRegion {
  int64_t signal, credit, send, recv, total;
  DC_HD NvshmemRegion(int ranks, int64_t slot_bytes) {
    int64_t off = 0;
    signal = off; off = align_up(off + int64_t(ranks) * 8, kAlign);
    credit = off; off = align_up(off + int64_t(ranks) * 8, kAlign);
    send = off;   off = align_up(off + int64_t(ranks) * slot_bytes, kAlign);
    recv = off;   off = align_up(off + int64_t(ranks) * slot_bytes, kAlign);
    total = off;
  }
};

// A rank's peer-mapped region of the NVLink hop (deepcomm/internode/node_link.py), for G GPUs per node:
//   flags  u64 [G]       flags[i]: the last barrier epoch node GPU i announced to us (kernels/node_barrier.hpp)
//   free   u64 [G]       free[i]: the last epoch node GPU i freed its area (kernels/hier_kernels.hpp)
//   arrive u64 [G]       arrive[i]: ... finished writing into ours
//   area   bytes [area]  rows the node's GPUs put here during one NVLink stage (area_bytes rounded up to 256)
// The words take the first 256-byte aligned part, the area starts after it.
// With several GPUs per node, the strip of call words at the end of every node GPU's NVLink area
// (deepcomm/internode/hier_agree.py): one kRailHeaderBytes header per rank, rail-major, rank (node m, GPU l) at
// slot l * nodes + m, so the words of one rail are contiguous (one put per node GPU in a count round, one run per
// rail in the kernels). `at`: its offset in an area of area_bytes (the kernels' words_at).
struct WordsStrip {
  int nodes, gpus;
  int64_t bytes, at;
  DC_HD WordsStrip(int num_nodes, int gpus_per_node, int64_t area_bytes)
      : nodes(num_nodes), gpus(gpus_per_node), bytes(int64_t(num_nodes) * gpus_per_node * kRailHeaderBytes),
        at(area_bytes - bytes) {}
  DC_HD int slot(int m, int l) const { return l * nodes + m; }
  DC_HD int slot_of_rank(int s) const { return slot(s / gpus, s % gpus); }
};

struct NodeLinkRegion {
  int64_t flags, free, arrive, area, area_bytes, total;
  DC_HD NodeLinkRegion(int gpus, int64_t area_sz) {
    flags = 0;
    free = flags + int64_t(gpus) * 8;
    arrive = free + int64_t(gpus) * 8;
    area = align_up(arrive + int64_t(gpus) * 8, kAlign);
    area_bytes = align_up(area_sz, kAlign);
    total = area + area_bytes;
  }
};

}  // namespace dc
