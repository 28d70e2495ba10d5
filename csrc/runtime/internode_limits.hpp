// How large an internode (hierarchical) topology can be: R = N nodes x G GPUs, rank r is GPU r % G of node r / G.
// Every internode layout, table and mask is sized by these; the extension exports them (INTERNODE_MAX_RANKS,
// INTERNODE_MAX_NODES) so Python never copies them. The NVLink domain (GPUs per node) keeps its own limit
// (kernels/node_barrier.hpp kMaxNodeGpus).
#pragma once
#include "host_device.hpp"

namespace dc {

constexpr int kInternodeMaxRanks = 256;  // 32 nodes x 8 GPUs
constexpr int kInternodeMaxNodes = 32;   // the hierarchical kernels give each node one lane of a warp
static_assert(kInternodeMaxNodes <= 32, "hier_dispatch.cu / hier_combine.cu hold one node per warp lane");

// A topology of `nodes` x `gpus` ranks that every internode table can hold (host checks and device asserts).
DC_HD constexpr bool internode_topology_fits(int nodes, int gpus) {
  return nodes >= 1 && nodes <= kInternodeMaxNodes && gpus >= 1 && nodes * gpus <= kInternodeMaxRanks;
}

}  // namespace dc
