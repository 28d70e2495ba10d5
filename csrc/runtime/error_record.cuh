// The record a kernel leaves when a device-side wait times out. It lives in pinned, mapped host memory so the
// host can read it without a device sync (and even while the kernel is still running).
#pragma once
#include <cstdint>

namespace dc {

// Stages name the wait that timed out. Keep the numbers stable. csrc/bindings/constants.cpp exports every one
// (WAIT_STAGES, name -> number); deepcomm/cuda/wait_stages.py gives each name its text.
enum WaitStage : int {
  kStageNone = 0,
  kStageNotifyCounts = 1,      // waiting for a peer's token counts
  kStageDispatchMailbox = 2,   // waiting for a peer to publish its receive offsets
  kStageDispatchDone = 3,      // waiting for a peer to finish writing rows into our output
  kStageCombineReady = 4,      // waiting for a peer to be ready for combine rows
  kStageCombineToken = 5,      // waiting for a peer's chunk of combine rows
  kStageBarrier = 6,           // a plain device barrier across ranks
  kStageLlCounts = 7,          // (retired: low-latency dispatch no longer exchanges counts before its data)
  kStageLlDispatchData = 8,    // low-latency dispatch: waiting for a peer's entries
  kStageLlCombineData = 9,     // low-latency combine: waiting for a peer's partial sums
  kStageLlCombineWeights = 10, // low-latency combine: waiting for a peer's top-k weights
  kStageAgree = 11,            // waiting for a peer's call fingerprint (csrc/runtime/agree_record.hpp)
  kStageNotifyLocal = 12,      // a fused fresh dispatch's payload blocks waiting for its own notify phase
  // Device queue pairs and the device emulated NIC (csrc/transport/qp_poster.hpp, nic_serve.hpp).
  kStageQpRoom = 20,           // a poster waiting for send-queue slots to be completed (CQEs)
  kStageQpTurn = 21,           // a poster waiting for earlier posts to ring the doorbell
  kStageQpQuiet = 22,          // waiting for every posted WQE up to an index to complete
  kStageNicDoorbell = 23,      // the device NIC waiting for WQEs (or a free CQE) while posters still run
  kStageQpErrorCqe = 24,       // not a wait: an error CQE (queue in error); the syndrome is in the poster state
  kStageQpSignal = 25,         // waiting for a signal (fetch-add) a peer's NIC delivers
  kStageInternodeCredit = 26,  // internode exchange: waiting for a peer to free its receive slot for us
  // The NVSHMEM transport of the internode exchange (deepcomm/internode/nvshmem_transport.py, counter_wait.hpp).
  kStageNvshmemCredit = 27,    // waiting for a peer to free its receive slot for us (its credit signal)
  kStageNvshmemSignal = 28,    // waiting for a peer's put-with-signal: its block for us has landed
  kStageNodeBarrier = 29,      // internode NVLink hop: waiting for a GPU of our node at the node barrier
  // The hierarchical internode kernels (csrc/kernels/hier_kernels.hpp).
  kStageHierFree = 30,         // waiting for a GPU of our node to free its area for this launch's rows
  kStageHierArrive = 31,       // waiting for a GPU of our node to finish writing rows into our area
  kStageHierLocal = 32,        // waiting for this launch's own blocks (packing or reducing done)
  // Not timeouts: input problems found on the device. Every rank stops the call consistently, so the Buffer
  // stays usable and the host raises ValueError.
  kStageInvalidIds = 100,      // some rank's topk_idx had ids outside [-1, E) (no host sync to catch it earlier)
  kStageOverflow = 101,        // a receiver's worst-case output (num_worst_tokens) is smaller than its rows
  // Found by low-latency dispatch, which never waits on the host: the call completed (bad slots as -1) and the
  // host raises at its next look at the record (the next call, a hook, or synchronize()).
  kStageLlInvalidIds = 102,
  kStageLlDuplicateIds = 103,
  // The ranks' call fingerprints differ (or a rank rejected its call): no row moved; the words are in the
  // AgreeRecord (csrc/runtime/agree_record.hpp).
  kStageDisagree = 104,
  // Found by get_dispatch_layout (local, no host sync): ids outside [-1, E) counted nowhere; the record's
  // waited_ns holds how many. Raised at the host's next look, like the low-latency ones.
  kStageLayoutInvalidIds = 105,
};

struct ErrorRecord {
  int flag;      // 0 = no error; set to 1 by the first waiter that timed out
  int rank;
  int peer;
  int stage;
  uint64_t seq;  // the collective's sequence number
  uint64_t waited_ns;  // a timeout: how long it waited; an input error: a count its text names, else 0
};

// What every waiting kernel needs to bound its waits. The collective's sequence number lives on the device
// (advanced by the call's first kernel: notify, or enter_call() in call_entry.cuh), so captured CUDA graphs get a
// new number on every replay; later kernels of the call read it once at entry with resolved(). A kernel whose
// number the host knows (the internode launches: their exchange round or node epoch) is given it in seq instead.
struct WaitCtx {
  ErrorRecord* err;          // device pointer to the mapped host record
  uint64_t timeout_ns;
  int rank;
  uint64_t seq;              // filled by resolved()
  const uint64_t* seq_ptr;   // this rank's device counter
  struct AgreeRecord* agree = nullptr;  // mapped host memory: where a call-fingerprint difference is recorded
  // Where the other mode's calls leave their words in our own memory (normal mode's waits look in the low-latency
  // buffer's agree slots, low-latency waits in the NVLink buffer's): `cross_sets` sets of [R] AgreeSlots from
  // `cross`, set j's slot of rank s at cross + (j * R + s) * kAgreeSlotBytes; null where there is none
  // (csrc/kernels/agree.cuh, agree_block).
  const uint8_t* cross = nullptr;
  int cross_sets = 0;

#if defined(__CUDACC__)
  __device__ __forceinline__ WaitCtx resolved() const {
    WaitCtx c = *this;
    c.seq = *seq_ptr;
    return c;
  }
#endif
};

}  // namespace dc
