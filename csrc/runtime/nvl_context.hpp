// Everything a rank's NVLink kernels need besides per-call arguments: the buffer layout, the peer pointer
// table, the error record and the timeout. Owned by the Python CudaBackend through the bindings.
#pragma once
#include <cstdint>

#include "../kernels/api.hpp"
#include "dispatch_counts.hpp"
#include "error_record.cuh"
#include "host_stamps.hpp"
#include "nvl_layout.hpp"

namespace dc {

struct NvlContext {
  NvlLayout layout;
  Peers peers{};
  int rank;
  ErrorRecord* err_device = nullptr;  // mapped host memory, device view
  const ErrorRecord* err_host = nullptr;  // the same record, host view (a host wait stops when it is set)
  DispatchCounts* counts_device = nullptr;  // mapped host memory: a fresh dispatch's counts, device view
  DispatchCounts* counts_host = nullptr;  // ... host view (the host clears the words it read)
  uint64_t timeout_ns = 100ull * 1000 * 1000 * 1000;
  AgreeRecord* agree_device = nullptr;  // mapped host memory: a call-fingerprint difference (agree_record.hpp)
  const uint8_t* cross = nullptr;  // our low-latency buffer's agree slots (WaitCtx::cross), null before it exists
  int cross_sets = 0;
  uint64_t* notify_trace = nullptr;  // diagnostics: where fresh dispatches' notify kernels stamp (NotifyArgs::trace)
  int64_t* host_stamps = nullptr;    // diagnostics: host memory [kHostStampPoints] a dispatch crossing stamps

  NvlContext(int rank_, int num_ranks, int local_experts_cap, int max_tokens, int64_t hidden_max, int64_t topk_max,
             int64_t arena_bytes)
      : layout(num_ranks, local_experts_cap, max_tokens, hidden_max, topk_max, arena_bytes), rank(rank_) {}

  WaitCtx wait_ctx() const {
    return WaitCtx{err_device, timeout_ns, rank, 0,
                   reinterpret_cast<const uint64_t*>(peers.base[rank] + layout.seq_counter), agree_device, cross,
                   cross_sets};
  }
  uint64_t* seq_counter() const { return reinterpret_cast<uint64_t*>(peers.base[rank] + layout.seq_counter); }
};

}  // namespace dc
