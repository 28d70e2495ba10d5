// What a rank's low-latency kernels need besides per-call arguments: the low-latency buffer layout, the peer
// table of that buffer, the shared error record and the timeout. Owned by deepcomm/cuda/ll_buffer.py.
#pragma once
#include <array>
#include <cstdint>
#include <string>

#include "../kernels/api.hpp"
#include "cuda_check.hpp"
#include "error_record.cuh"
#include "ll_layout.hpp"

namespace dc {

struct LlContext {
  LlLayout layout;
  LlPeers peers{};                                // what the kernels take (api.hpp)
  std::array<uint8_t*, kLlMaxRanks> bases{};      // every rank's base: the device table's contents (set_peer_table)
  int rank;
  ErrorRecord* err_device = nullptr;
  uint64_t timeout_ns = 100ull * 1000 * 1000 * 1000;
  AgreeRecord* agree_device = nullptr;  // shared with the NVLink buffer (agree_record.hpp)
  const uint8_t* cross = nullptr;  // our NVLink buffer's agree slots (WaitCtx::cross), null where there is none
  int cross_sets = 0;
  uint64_t* trace = nullptr;  // diagnostics: [kMaxBlocks][kLlTracePoints] timer stamps, or null (ll_trace_points.hpp)
  int pdl = 0;                // programmatic dependent launch: 0 off, 1 on with an early trigger, 2 on (ll_gate)

  // outbox: room for peers reached by puts (csrc/runtime/ll_layout.hpp "outbox")
  LlContext(int rank_, int num_ranks, int num_experts, int max_tokens, int64_t hidden, int topk_max,
            bool outbox = false)
      : layout(num_ranks, num_experts, max_tokens, hidden, topk_max, outbox), rank(rank_) {
    DC_HOST_ASSERT(num_ranks >= 1 && num_ranks <= kLlMaxRanks,
                   "low-latency mode: at most " + std::to_string(kLlMaxRanks) + " ranks (LL_MAX_RANKS)");
    DC_HOST_ASSERT(rank_ >= 0 && rank_ < num_ranks, "low-latency mode: rank out of range");
  }

  void set_peer(int r, uint8_t* base) {
    DC_HOST_ASSERT(r >= 0 && r < layout.num_ranks, "set_peer: rank out of range");
    bases[r] = base;
    if (r < kLlInlinePeers)
      peers.base[r] = base;
    else
      peers.all = nullptr;  // the device table no longer holds every base: set_peer_table again
  }

  // The peer table for a launch: past kLlInlinePeers ranks the device copy of `bases` must have been given.
  const LlPeers& launch_peers() const {
    DC_HOST_ASSERT(layout.num_ranks <= kLlInlinePeers || peers.all != nullptr,
                   "low-latency mode: more than " + std::to_string(kLlInlinePeers) +
                       " ranks need the peer table in device memory (LlContext.set_peer_table after set_peer)");
    return peers;
  }

  // The low-latency kernels keep their own call numbers in the buffer (csrc/kernels/ll_common.cuh).
  WaitCtx wait_ctx() const {
    return WaitCtx{err_device, timeout_ns, rank, 0, nullptr, agree_device, cross, cross_sets};
  }
};

}  // namespace dc
