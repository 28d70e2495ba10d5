#include "host_qp.hpp"

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace dc::transport {

namespace {

// Zeroed, 64-byte aligned (WQEBBs and CQEs are read as aligned words).
template <typename T>
T* alloc_zeroed(size_t bytes) {
  bytes = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes);
  if (p == nullptr) throw std::bad_alloc();
  memset(p, 0, bytes);
  return static_cast<T*>(p);
}

}  // namespace

HostQueuePair::HostQueuePair(uint32_t log_wqebbs, uint32_t log_cqes, uint32_t qpn) {
  if (log_wqebbs > kMaxLogWqebbs) throw std::invalid_argument("HostQueuePair: at most 2^15 WQEBBs");
  if (log_cqes > kMaxLogCqes) throw std::invalid_argument("HostQueuePair: at most 2^16 CQEs");
  if (qpn > 0xffffffu) throw std::invalid_argument("HostQueuePair: the QPN has 24 bits");
  sq_ = SqRing{alloc_zeroed<uint8_t>(size_t(kWqebbBytes) << log_wqebbs), log_wqebbs, qpn};
  dbrec_ = alloc_zeroed<uint32_t>(2 * sizeof(uint32_t));
  doorbell_reg_ = alloc_zeroed<uint64_t>(sizeof(uint64_t));
  cq_dbrec_ = alloc_zeroed<uint32_t>(sizeof(uint32_t));
  cq_ = CqRing{alloc_zeroed<uint8_t>(size_t(kCqeBytes) << log_cqes), log_cqes, cq_dbrec_};
  cq_init(cq_);
  wqebbs_of_slot_.assign(sq_.wqebbs(), 1);
}

HostQueuePair::~HostQueuePair() {
  std::free(sq_.wqes);
  std::free(cq_.cqes);
  std::free(dbrec_);
  std::free(doorbell_reg_);
  std::free(cq_dbrec_);
}

void HostQueuePair::reserve(uint32_t wqebbs) const {
  if (wqebbs > free_wqebbs())
    throw std::runtime_error("send queue full: " + std::to_string(pi_ - sq_ci_) + " of " +
                             std::to_string(sq_.wqebbs()) + " WQEBBs not yet completed; poll completions first");
}

uint32_t HostQueuePair::advance(uint32_t index, uint32_t wqebbs) {
  wqebbs_of_slot_[index & (sq_.wqebbs() - 1)] = uint8_t(wqebbs);
  pi_ += wqebbs;
  return index;
}

uint32_t HostQueuePair::post_write(const RdmaWrite& w, const WqeCtrl& c) {
  reserve(wqebbs_of_ds(kDsRdmaWrite));
  return advance(pi_, encode_rdma_write(sq_, pi_, w, c));
}

uint32_t HostQueuePair::post_write_inline(const void* payload, uint32_t bytes, uint64_t raddr, uint32_t rkey,
                                          const WqeCtrl& c) {
  if (bytes > kMaxInlineBytes)
    throw std::invalid_argument("inline write: at most " + std::to_string(kMaxInlineBytes) + " bytes");
  reserve(wqebbs_of_ds(ds_inline_write(bytes)));
  return advance(pi_, encode_rdma_write_inline(sq_, pi_, payload, bytes, raddr, rkey, c));
}

uint32_t HostQueuePair::post_fetch_add(const FetchAdd& a, const WqeCtrl& c) {
  reserve(wqebbs_of_ds(kDsFetchAdd));
  return advance(pi_, encode_fetch_add(sq_, pi_, a, c));
}

void HostQueuePair::ring() { ring_doorbell(SqDoorbell{dbrec_, doorbell_reg_}, pi_, sq_.qpn); }

std::vector<Completion> HostQueuePair::poll(uint32_t max) {
  std::vector<Completion> out;
  Completion c;
  while (out.size() < max && cq_poll(cq_, cq_ci_, &c)) {
    out.push_back(c);
    ++cq_ci_;
    // wqe_counter is 16 bits; it names a WQE in [sq_ci_, pi_), and retires it with everything before it.
    const uint32_t start = sq_ci_ + uint16_t(c.wqe_counter - uint16_t(sq_ci_));
    sq_ci_ = start + wqebbs_of_slot_[start & (sq_.wqebbs() - 1)];
  }
  if (!out.empty()) cq_set_consumer_index(cq_, cq_ci_);
  return out;
}

NicQueue HostQueuePair::nic_view() const {
  NicQueue q;
  q.sq = sq_;
  q.dbrec = dbrec_;
  q.cq = cq_;
  return q;
}

}  // namespace dc::transport
