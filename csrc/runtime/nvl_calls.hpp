// The host side of one normal-mode call on the NVLink kernels, in one crossing from Python: the stream order
// (the communication stream after the caller's work or the user's event; the caller after the call unless
// async), the launches, and for a fresh dispatch the wait for its counts in mapped host memory (no device-to-host
// copy, no stream sync). Python keeps the tensors and the arena; this file sees pointers, streams and events.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "../kernels/api.hpp"
#include "nvl_context.hpp"

namespace dc {

struct StreamOrder {
  cudaStream_t caller = nullptr, comm = nullptr;
  cudaEvent_t previous = nullptr;  // the user's previous_event: comm waits for it (nullable)
  cudaEvent_t start = nullptr;     // recorded on the caller's stream when comm must wait for the caller
  bool wait_caller = true;
  cudaEvent_t end = nullptr;       // recorded on comm at the end of the call (null: comm is the caller's stream)
  bool caller_waits = true;        // the caller's stream waits for `end` (not async_finish)
  void begin() const;
  void finish() const;
};

// A dispatch call: which steps this crossing takes (a fresh dispatch whose output block is reserved for the
// worst case takes them all in one; one whose arena is full takes notify + wait, then payload in a second).
struct NvlDispatchCall {
  bool begin = true, notify = false, bump = false, payload = true, wait = false, finish = true;
  NotifyArgs notify_args{};
  DispatchArgs dispatch{};
  int num_blocks = 1;
  int expert_alignment = 1;
  double wait_timeout_s = 0.0;
};

struct NvlDispatchResult {
  int status = 0;           // 0 ok; 1 the counts never came (see the error record); 2 bad expert ids;
                            // 3 the ranks' call fingerprints differ (DispatchCounts::disagree)
  int num_recv = -1;        // rows received (known after a wait, or out_rows)
  int bad_all = 0, bad_mine = 0;
  std::vector<int> per_expert;  // aligned rows per local expert (after a wait)
  int64_t out[6] = {0, 0, 0, 0, 0, 0};  // DispatchOutLayout of the output block for num_recv rows
  double waited_us = 0.0;   // host time spent waiting for the counts
};

NvlDispatchResult nvl_dispatch(const NvlContext& c, const StreamOrder& order, const NvlDispatchCall& call);

void nvl_combine(const NvlContext& c, const StreamOrder& order, const CombineArgs& args, int num_blocks);

}  // namespace dc
