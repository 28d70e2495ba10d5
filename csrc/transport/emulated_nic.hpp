// The consumer side of a send queue, as a pure function of memory: read the doorbell record, decode each posted
// WQE in order, execute it (RDMA write = copy to the translated remote address; fetch-add = 8-byte atomic on the
// remote counter, old value to the local buffer), and post completions. Host and device code alike: the CPU
// proxy calls nic_drain from a thread; a device-side NIC would call it from one GPU thread per queue.
//
// Like an RC queue pair, the first failing WQE completes with an error CQE and moves the queue to error: every
// later WQE is flushed (an error CQE with syndrome WR_FLUSH_ERR, no memory effects). Successful WQEs complete
// only when signaled (kCtrlCqUpdate); a CQE's wqe_counter also retires the unsignaled WQEs before it.
// Fetch-add operates on a host-endian counter and returns the old value host-endian: a ConnectX NIC does that
// in the "host endianness" atomic mode (atomic_req_8B_endianness_mode, verbs IBV_ATOMIC_HCA).
#pragma once
#include <cstdint>

#include "cq_ring.hpp"
#include "key_table.hpp"
#include "wqe_decode.hpp"

namespace dc::transport {

struct NicQueue {
  SqRing sq;
  const uint32_t* dbrec;  // the send queue's doorbell record
  CqRing cq;
  uint32_t ci = 0;        // next WQEBB to consume
  uint32_t cq_pi = 0;     // next CQE to write
  uint8_t error = kSyndromeNone;  // syndrome of the WQE that put the queue in error
};

enum DrainStatus : uint8_t {
  kDrainCaughtUp = 0,  // consumed everything the doorbell record announced
  kDrainCqFull = 1,    // stopped: the consumer has not freed a CQE
  kDrainBudget = 2,    // stopped after max_wqes
};

struct DrainResult {
  uint32_t wqes;
  DrainStatus status;
};

// Where a (non-inline) RDMA write reads and writes, through the key table; its error syndrome otherwise.
DC_HD uint8_t nic_translate_write(const DecodedWqe& w, const KeyTable& keys, uint8_t** remote, const uint8_t** local) {
  *remote = keys.translate(w.rkey, w.raddr, w.bytes);
  if (*remote == nullptr) return kSyndromeRemoteAccess;
  *local = keys.translate(w.lkey, w.laddr, w.bytes);
  if (*local == nullptr) return kSyndromeLocalProt;
  return kSyndromeNone;
}

// Execute one decoded WQE; returns its error syndrome (kSyndromeNone on success).
DC_HD uint8_t nic_execute(const SqRing& sq, const DecodedWqe& w, const KeyTable& keys) {
  if (w.opcode == kOpAtomicFetchAdd) {
    auto* remote = reinterpret_cast<uint64_t*>(keys.translate(w.rkey, w.raddr, 8));
    if (remote == nullptr || (w.raddr & 7u) != 0) return kSyndromeRemoteAccess;
    uint8_t* local = keys.translate(w.lkey, w.laddr, 8);
    if (local == nullptr || w.bytes != 8) return kSyndromeLocalProt;
    const uint64_t old = fetch_add_release_u64(remote, w.add);
    memcpy(local, &old, 8);
    return kSyndromeNone;
  }
  if (w.is_inline) {
    uint8_t* remote = keys.translate(w.rkey, w.raddr, w.bytes);
    if (remote == nullptr) return kSyndromeRemoteAccess;
    copy_inline_payload(sq, w.wqe_index, remote, w.bytes);
    return kSyndromeNone;
  }
  uint8_t* remote;
  const uint8_t* local;
  const uint8_t syndrome = nic_translate_write(w, keys, &remote, &local);
  if (syndrome == kSyndromeNone) memcpy(remote, local, w.bytes);
  return syndrome;
}

DC_HD uint8_t syndrome_of_decode(DecodeStatus s) {
  return s == kDecodeBadOpcode ? kSyndromeRemoteInvReq : kSyndromeLocalQpOp;
}

// The WQE at the consumer index, decoded and checked against the doorbell (pi), before anything executes.
struct NicStep {
  DecodedWqe w;
  uint8_t syndrome;  // kSyndromeNone: execute it; otherwise it completes with this error, no memory effects
  uint32_t step;     // WQEBBs to consume
};

DC_HD NicStep nic_decode_next(const NicQueue& q, uint16_t pi) {
  NicStep s;
  DecodeStatus ds = decode_wqe(q.sq, q.ci, &s.w);
  const bool consistent = s.w.wqe_index == uint16_t(q.ci) && s.w.qpn == q.sq.qpn &&
                          s.w.wqebbs() <= wqebbs_pending(pi, q.ci);  // not past what the doorbell announced
  if (ds == kDecodeOk && !consistent) ds = kDecodeBadSize;
  s.step = ds == kDecodeOk ? s.w.wqebbs() : 1u;  // an unparsable WQE has no trustworthy size
  s.syndrome = kSyndromeNone;
  if (q.error != kSyndromeNone) s.syndrome = kSyndromeWrFlush;
  else if (ds != kDecodeOk) s.syndrome = syndrome_of_decode(ds);
  return s;
}

// After execution (syndrome = the step's, or what executing it returned): error state, CQE, consumer index.
DC_HD void nic_complete(NicQueue& q, const NicStep& s, uint8_t syndrome) {
  if (syndrome != kSyndromeNone && q.error == kSyndromeNone) q.error = syndrome;
  if (syndrome != kSyndromeNone || (s.w.fm_ce_se & kCtrlCqUpdate)) {
    Completion c{};
    c.wqe_counter = uint16_t(q.ci);
    c.wqe_opcode = s.w.opcode;
    c.cqe_opcode = syndrome == kSyndromeNone ? kCqeReq : kCqeReqErr;
    c.syndrome = syndrome;
    c.qpn = q.sq.qpn;
    c.byte_count = syndrome == kSyndromeNone ? s.w.bytes : 0;
    cq_write(q.cq, q.cq_pi, c);
    ++q.cq_pi;
  }
  q.ci += s.step;
}

// Consume up to max_wqes WQEs announced by the doorbell record.
DC_HD DrainResult nic_drain(NicQueue& q, const KeyTable& keys, uint32_t max_wqes) {
  const uint16_t pi = read_producer_index(q.dbrec);
  DrainResult r{0, kDrainCaughtUp};
  while (wqebbs_pending(pi, q.ci) != 0) {
    if (r.wqes == max_wqes) return DrainResult{r.wqes, kDrainBudget};
    if (cq_room(q.cq, q.cq_pi) == 0) return DrainResult{r.wqes, kDrainCqFull};
    const NicStep s = nic_decode_next(q, pi);
    const uint8_t syndrome = s.syndrome != kSyndromeNone ? s.syndrome : nic_execute(q.sq, s.w, keys);
    nic_complete(q, s, syndrome);
    ++r.wqes;
  }
  return r;
}

}  // namespace dc::transport
