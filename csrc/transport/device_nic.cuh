// The emulated NIC as a GPU thread: nic_drain (the same function the CPU proxy runs) in a loop, executing WQEs
// through the key table, whose regions point at NVLink peer memory of the GPU that plays the remote node.
//
// It must run concurrently with the posters. The safe way used here: the NIC is one thread of a dedicated block
// of the same grid as the posters, with the grid no larger than the number of SMs, so every block is resident.
// On a cluster a ConnectX replaces that block and reads the same bytes.
//
// It stops once `*stop_word >= stop_target` (posters count themselves done after their last doorbell) and the
// doorbell record announces nothing more. Its waits go through wait_until: posters that stop posting without
// finishing give a kStageNicDoorbell timeout, never a hang.
#pragma once
#include "../runtime/wait.cuh"
#include "device_qp_layout.hpp"

namespace dc::transport {

// One thread. Returns false on timeout (recorded in ctx). Leaves its counters in *stats.
__device__ inline bool nic_serve(NicQueue& q, const KeyTable& keys, const uint32_t* stop_word, uint32_t stop_target,
                                 const WaitCtx& ctx, int peer, NicStats* stats, uint32_t batch = 64) {
  uint32_t wqes = 0;
  bool ok = true;
  for (;;) {
    const DrainResult r = nic_drain(q, keys, batch);
    wqes += r.wqes;
    if (r.wqes != 0) continue;
    // Nothing executable: wait for a new doorbell, a freed CQE, or the end. Read the stop word first: the
    // doorbells it covers are then visible to the producer-index read that follows.
    bool finished = false;
    ok = wait_until([&] {
      finished = ptx::ld_acquire_sys_u32(stop_word) >= stop_target;
      const bool pending = wqebbs_pending(read_producer_index(q.dbrec), q.ci) != 0;
      if (pending) return cq_room(q.cq, q.cq_pi) != 0;
      return finished;
    }, ctx, peer, kStageNicDoorbell);
    if (!ok) break;
    if (finished && wqebbs_pending(read_producer_index(q.dbrec), q.ci) == 0) break;
  }
  stats->consumed = q.ci;
  stats->wqes = wqes;
  stats->cqes = q.cq_pi;
  stats->error = q.error;
  ptx::st_release_sys_u32(&stats->stopped, 1u);
  return ok;
}

}  // namespace dc::transport
