// A barrier among the GPUs of one node, over NVLink peer pointers: the synchronization of the internode path's
// NVLink hop (deepcomm/internode/node_link.py). Torch copies write rows into node peers' memory before it and read
// their own memory after it, on the same stream.
//
// Each GPU g of the node owns flags u64 [gpus] in its peer-mapped memory; flags[i] = the last epoch GPU i
// announced to g. One launch, one thread per node GPU i != local:
//   1. fence.acq_rel.sys, then a release store (system scope) of `epoch` into GPU i's flags[local]: everything
//      this GPU's earlier work on the stream wrote (into any node GPU) is visible before the flag;
//   2. wait (bounded, kStageNodeBarrier, peer = that GPU's global rank) until our flags[i] >= epoch.
// Epochs are 1, 2, ... and the same on every GPU of the node (every GPU makes the same barriers), so flags only
// grow and never need a reset.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../runtime/error_record.cuh"

namespace dc {

constexpr int kMaxNodeGpus = 32;

struct NodeBarrierArgs {
  uint64_t* flags;                        // ours: u64 [gpus]
  uint64_t* peer_flags[kMaxNodeGpus];     // GPU i's flags as mapped here (ours at `local`)
  int gpus;                               // GPUs in the node, 1..kMaxNodeGpus
  int local;                              // our index in the node
  int first_rank;                         // global rank of the node's GPU 0 (for error reports)
  uint64_t epoch;
};

// Launch one barrier on `stream` (one block; nothing to do for a node of one GPU).
void launch_node_barrier(const NodeBarrierArgs& args, const WaitCtx& ctx, cudaStream_t stream);

}  // namespace dc
