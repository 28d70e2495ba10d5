// The emulated NIC as one thread: nic_drain (the function the CpuProxy also runs) in a loop, executing WQEs
// through the key table, whose regions point at NVLink peer memory of the GPU that plays the remote node.
//
// On the GPU it must run concurrently with the posters. The safe way used here: the NIC is one thread of a
// dedicated block of the same grid as the posters, with the grid no larger than the number of SMs, so every
// block is resident. On a cluster a ConnectX replaces that block and reads the same bytes. The CPU checks run
// the same function in a std::thread (csrc/selftest/qp_host_selftest.cpp).
//
// It stops once `*stop_word >= stop_target` (posters count themselves done after their last doorbell) and the
// doorbell record announces nothing more. Waits go through the Waiter (see qp_poster.hpp): posters that stop
// posting without finishing give a kStageNicDoorbell timeout, never a hang.
#pragma once
#include "../runtime/error_record.cuh"
#include "device_qp_layout.hpp"

namespace dc::transport {

// Returns false on timeout (recorded by the waiter). Leaves its counters in *stats.
template <typename Waiter>
DC_HD bool nic_serve(NicQueue& q, const KeyTable& keys, const uint32_t* stop_word, uint32_t stop_target,
                     const Waiter& waiter, NicStats* stats, uint32_t batch = 64) {
  uint32_t wqes = 0;
  bool ok = true;
  for (;;) {
    const DrainResult r = nic_drain(q, keys, batch);
    wqes += r.wqes;
    if (r.wqes != 0) continue;
    // Nothing executable: wait for a new doorbell, a freed CQE, or the end. Read the stop word first: the
    // doorbells it covers are then visible to the producer-index read that follows.
    bool finished = false;
    ok = waiter.wait([&] {
      finished = load_acquire_u32(stop_word) >= stop_target;
      const bool pending = wqebbs_pending(read_producer_index(q.dbrec), q.ci) != 0;
      if (pending) return cq_room(q.cq, q.cq_pi) != 0;
      return finished;
    }, kStageNicDoorbell);
    if (!ok) break;
    if (finished && wqebbs_pending(read_producer_index(q.dbrec), q.ci) == 0) break;
  }
  stats->consumed = q.ci;
  stats->wqes = wqes;
  stats->cqes = q.cq_pi;
  stats->error = q.error;
  store_release_u32(&stats->stopped, 1u);
  return ok;
}

}  // namespace dc::transport
