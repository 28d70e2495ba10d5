// What a rank's low-latency kernels need besides per-call arguments: the low-latency buffer layout, the peer
// table of that buffer, the shared error record and the timeout. Owned by deepcomm/cuda/ll_buffer.py.
#pragma once
#include <cstdint>
#include <string>

#include "../kernels/api.hpp"
#include "cuda_check.hpp"
#include "error_record.cuh"
#include "ll_layout.hpp"

namespace dc {

struct LlContext {
  LlLayout layout;
  LlPeers peers{};
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

  // The low-latency kernels keep their own call numbers in the buffer (csrc/kernels/ll_common.cuh).
  WaitCtx wait_ctx() const {
    return WaitCtx{err_device, timeout_ns, rank, 0, nullptr, agree_device, cross, cross_sets};
  }
};

}  // namespace dc
