// A send queue and its completion queue in host memory, with the poster's side of both: encode WQEs at the
// producer index, ring the doorbell, poll completions and retire send-queue slots from them. Whatever drains it
// (nic_drain in this thread, or a CpuProxy in another) sees only the ring, the doorbell record and the CQ.
#pragma once
#include <cstdint>
#include <vector>

#include "emulated_nic.hpp"
#include "wqe_encode.hpp"

namespace dc::transport {

class HostQueuePair {
 public:
  HostQueuePair(uint32_t log_wqebbs, uint32_t log_cqes, uint32_t qpn);
  ~HostQueuePair();
  HostQueuePair(const HostQueuePair&) = delete;
  HostQueuePair& operator=(const HostQueuePair&) = delete;

  // Each post encodes one WQE at the producer index and returns its WQE index; nothing is visible to the NIC
  // until ring(). A post that does not fit in the free slots throws std::runtime_error.
  uint32_t post_write(const RdmaWrite& w, const WqeCtrl& c);
  uint32_t post_write_inline(const void* payload, uint32_t bytes, uint64_t raddr, uint32_t rkey, const WqeCtrl& c);
  uint32_t post_fetch_add(const FetchAdd& a, const WqeCtrl& c);
  void ring();

  // Completions the NIC has written since the last poll (at most max); frees the CQEs and the WQEBBs they retire.
  std::vector<Completion> poll(uint32_t max);

  // What a NIC needs to drain this queue (its consumer state starts at zero).
  NicQueue nic_view() const;

  uint32_t producer_index() const { return pi_; }
  uint32_t retired_index() const { return sq_ci_; }
  uint32_t free_wqebbs() const { return sq_.wqebbs() - (pi_ - sq_ci_); }
  const SqRing& sq() const { return sq_; }
  const CqRing& cq() const { return cq_; }
  const uint32_t* dbrec() const { return dbrec_; }
  uint64_t doorbell_register() const { return *doorbell_reg_; }

 private:
  void reserve(uint32_t wqebbs) const;
  uint32_t advance(uint32_t index, uint32_t wqebbs);  // records a posted WQE's size, moves the producer index

  SqRing sq_{};
  CqRing cq_{};
  uint32_t* dbrec_ = nullptr;        // [0] receive (unused), [1] send
  uint64_t* doorbell_reg_ = nullptr;
  uint32_t* cq_dbrec_ = nullptr;
  std::vector<uint8_t> wqebbs_of_slot_;  // size of the WQE that starts at each slot, to retire it
  uint32_t pi_ = 0;
  uint32_t sq_ci_ = 0;
  uint32_t cq_ci_ = 0;
};

}  // namespace dc::transport
