// A bounded wait on the GPU, in stream order: until every peer's 64-bit counter in a local array reaches a target
// (the peers: the ranks set in a bit mask; the hierarchical internode path exchanges only with its rail ranks).
// The NVSHMEM transport of the internode exchange (deepcomm/internode/nvshmem_transport.py) launches it instead of
// nvshmemx_signal_wait_until_on_stream, which would wait forever for a missing peer: this one gives up after
// ctx.timeout_ns and records (rank, peer, stage) in the ErrorRecord, like every deepcomm wait.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../runtime/error_record.cuh"

namespace dc {

constexpr int kMaxCounterWaitRanks = 1024;  // one thread per rank, one block

struct CounterWaitArgs {
  const uint64_t* counters;  // device pointer: u64 [world_size], counters[p] raised by peer p (release or signal)
  int world_size;            // 1..kMaxCounterWaitRanks
  int rank;                  // our own entry is skipped (even if its bit is set)
  uint64_t target;           // wait until counters[p] >= target for every peer p
  int stage;                 // WaitStage recorded on a timeout
  uint32_t peer_mask[kMaxCounterWaitRanks / 32];  // bit p set: rank p is a peer (waited on); others are skipped
};

void launch_counter_wait(const CounterWaitArgs& args, const WaitCtx& ctx, cudaStream_t stream);

}  // namespace dc
