// One peer's side of an internode exchange round (the protocol of internode_exchange.hpp), for one posting thread:
// host and device code over a Waiter, like qp_poster.hpp, so CPU threads run exactly this in CI
// (csrc/selftest/internode_host_selftest.cpp) and GPU threads in the exchange kernel (internode_exchange.cu).
#pragma once
#include "../transport/qp_poster.hpp"
#include "internode_exchange.hpp"

namespace dc {

// Wait until the 64-bit counter at `flag` (raised by a peer's NIC) reaches `target`.
template <typename Waiter>
DC_HD bool internode_wait_counter(const uint64_t* flag, uint64_t target, const Waiter& waiter, int stage) {
  return waiter.wait([&] { return transport::load_acquire_u64(flag) >= target; }, stage);
}

// The signal after the block (same queue: it executes after the writes), then wait for all our WQEs.
template <typename Waiter>
DC_HD bool internode_signal_and_quiet(const InternodeExchangeArgs& a, const InternodePeer& p,
                                      const transport::DeviceQp& qp, const Waiter& waiter) {
  using namespace transport;
  const WqeCtrl signaled;
  uint32_t index = 0;
  return qp_post_fetch_add(qp, FetchAdd{p.fa_old_addr + 8, a.lkey, p.signal_addr, uint32_t(p.rkey), 1}, signaled,
                           waiter, &index) &&
         qp_quiet(qp, index + wqebbs_of_ds(kDsFetchAdd), waiter);
}

// Steps 1-4 and the quiet of step 5 (internode_exchange.hpp). False on a timeout or an error CQE.
template <typename Waiter>
DC_HD bool internode_post_round(const InternodeExchangeArgs& a, const InternodePeer& p, const transport::DeviceQp& qp,
                                const Waiter& waiter) {
  using namespace transport;
  const uint32_t rkey = uint32_t(p.rkey);
  const WqeCtrl signaled;  // every WQE completes: retirement never waits on a later signal
  bool ok = qp_post_fetch_add(qp, FetchAdd{p.fa_old_addr, a.lkey, p.credit_addr, rkey, 1}, signaled, waiter);
  ok = ok && internode_wait_counter(reinterpret_cast<const uint64_t*>(p.credit_ptr), a.round, waiter,
                                    kStageInternodeCredit);
  if (ok && p.send_bytes != 0 && p.send_bytes <= kMaxInlineBytes) {
    // Small blocks (the count exchange) travel inside the WQE. Our send area is registered at its own address,
    // so the WQE address is also our pointer to the payload.
    return qp_post_write_inline(qp, reinterpret_cast<const uint8_t*>(p.send_addr), uint32_t(p.send_bytes),
                                p.recv_addr, rkey, signaled, waiter) &&
           internode_signal_and_quiet(a, p, qp, waiter);
  }
  for (uint64_t off = 0; ok && off < p.send_bytes; off += a.chunk_bytes) {
    const uint64_t left = p.send_bytes - off;
    const uint32_t n = uint32_t(left < a.chunk_bytes ? left : a.chunk_bytes);
    ok = qp_post_write(qp, RdmaWrite{p.send_addr + off, a.lkey, p.recv_addr + off, rkey, n}, signaled, false,
                       waiter);
  }
  return ok && internode_signal_and_quiet(a, p, qp, waiter);
}

}  // namespace dc
