// The record a kernel leaves when a device-side wait times out. It lives in pinned, mapped host memory so the
// host can read it without a device sync (and even while the kernel is still running).
#pragma once
#include <cstdint>

namespace dc {

// Stages name the wait that timed out; deepcomm/cuda/errors.py maps them to text. Keep the numbers stable.
enum WaitStage : int {
  kStageNone = 0,
  kStageNotifyCounts = 1,      // waiting for a peer's token counts
  kStageDispatchMailbox = 2,   // waiting for a peer to publish its receive offsets
  kStageDispatchDone = 3,      // waiting for a peer to finish writing rows into our output
  kStageCombineReady = 4,      // waiting for a peer to be ready for combine rows
  kStageCombineToken = 5,      // waiting for a peer's chunk of combine rows
  kStageBarrier = 6,           // a plain device barrier across ranks
};

struct ErrorRecord {
  int flag;      // 0 = no error; set to 1 by the first waiter that timed out
  int rank;
  int peer;
  int stage;
  uint64_t seq;  // the collective's sequence number
  uint64_t waited_ns;
};

// What every waiting kernel needs to bound its waits.
struct WaitCtx {
  ErrorRecord* err;     // device pointer to the mapped host record
  uint64_t timeout_ns;
  int rank;
  uint64_t seq;
};

}  // namespace dc
