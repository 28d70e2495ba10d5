// The completion queue: a ring of 2^n 64-byte CQEs in the mlx5_cqe64 layout (rdma-core mlx5dv.h), big-endian.
// Only the fields a send queue's completion needs are written:
//   byte 44  byte_cnt      be32  bytes moved
//   byte 54  vendor_err_synd, byte 55 syndrome   (error CQEs, mlx5_err_cqe)
//   byte 56  sop_drop_qpn  be32  [31:24] opcode of the completed WQE, [23:0] QPN
//   byte 60  wqe_counter   be16  WQE index of the completed WQE (its first WQEBB)
//   byte 63  op_own        [7:4] CQE opcode (0 = requester, 13 = requester error, 15 = invalid), [0] owner
// Ownership: the CQE written at producer index p carries owner bit (p >> n) & 1, so it flips on every pass; the
// consumer at index ci takes a CQE whose opcode is not "invalid" and whose owner bit is (ci >> n) & 1 (rdma-core
// mlx5 poll_cq and UCX uct_ib_mlx5_cqe_is_hw_owned). Fresh CQEs are "invalid" with owner 0, as rdma-core
// initialises them. Bytes 56-63 are written as one 8-byte release store after the rest, so a consumer that sees
// the owner bit sees the whole CQE.
// The consumer reports its index in the CQ doorbell record (big-endian, 24 bits, like mlx5's set_ci record); the
// emulated NIC reads it to avoid overwriting CQEs not yet polled.
#pragma once
#include <cstdint>

#include "mlx5_wqe.hpp"

namespace dc::transport {

constexpr uint32_t kCqeBytes = 64;
constexpr uint32_t kMaxLogCqes = 16;

enum CqeOpcode : uint8_t {
  kCqeReq = 0,      // MLX5_CQE_REQ
  kCqeReqErr = 13,  // MLX5_CQE_REQ_ERR
  kCqeInvalid = 15, // MLX5_CQE_INVALID
};

// MLX5_CQE_SYNDROME_* used by the emulated NIC.
enum CqeSyndrome : uint8_t {
  kSyndromeNone = 0x00,
  kSyndromeLocalQpOp = 0x02,     // malformed WQE (size, index or QPN)
  kSyndromeLocalProt = 0x04,     // lkey does not cover the local buffer
  kSyndromeWrFlush = 0x05,       // WQE flushed because an earlier one failed
  kSyndromeRemoteInvReq = 0x12,  // opcode not supported
  kSyndromeRemoteAccess = 0x13,  // rkey does not cover the remote buffer
};

struct Completion {
  uint16_t wqe_counter;
  uint8_t wqe_opcode;
  uint8_t cqe_opcode;
  uint8_t syndrome;
  uint8_t owner;
  uint32_t qpn;
  uint32_t byte_count;
};

struct CqRing {
  uint8_t* cqes;       // 2^log_cqes CQEs, 64-byte aligned
  uint32_t log_cqes;
  uint32_t* dbrec;     // consumer index record, written by the consumer

  DC_HD uint32_t size() const { return 1u << log_cqes; }
  DC_HD uint8_t* cqe(uint32_t index) const { return cqes + (uint64_t(index & (size() - 1)) * kCqeBytes); }
};

DC_HD void cq_init(const CqRing& cq) {
  for (uint32_t i = 0; i < cq.size(); ++i) {
    uint8_t* c = cq.cqe(i);
    for (uint32_t b = 0; b < kCqeBytes; b += 8) store_u64(c + b, 0);
    c[63] = uint8_t(kCqeInvalid << 4);
  }
  *cq.dbrec = 0;
}

DC_HD uint64_t cqe_tail_word(const Completion& c, uint32_t pi, uint32_t log_cqes) {
  const uint8_t op_own = uint8_t((c.cqe_opcode << 4) | ((pi >> log_cqes) & 1u));
  return uint64_t(be32((uint32_t(c.wqe_opcode) << 24) | (c.qpn & 0xffffffu))) |
         (uint64_t(be16(c.wqe_counter)) << 32) | (uint64_t(op_own) << 56);
}

// Producer (NIC) side: fill the CQE at producer index pi. c.owner is ignored (it follows from pi).
DC_HD void cq_write(const CqRing& cq, uint32_t pi, const Completion& c) {
  uint8_t* e = cq.cqe(pi);
  for (uint32_t b = 0; b < 56; b += 8) store_u64(e + b, 0);
  store_u64(e + 40, uint64_t(be32(c.byte_count)) << 32);                           // byte_cnt at 44
  store_u64(e + 48, (uint64_t(c.syndrome) << 56));                                 // syndrome at 55
  store_release_u64(reinterpret_cast<uint64_t*>(e + 56), cqe_tail_word(c, pi, cq.log_cqes));
}

// Consumer side: the CQE at consumer index ci, if the NIC has written it on this pass.
DC_HD bool cq_poll(const CqRing& cq, uint32_t ci, Completion* out) {
  const uint8_t* e = cq.cqe(ci);
  const uint64_t tail = load_acquire_u64(reinterpret_cast<const uint64_t*>(e + 56));
  const uint8_t op_own = uint8_t(tail >> 56);
  if ((op_own >> 4) == kCqeInvalid || (op_own & 1u) != ((ci >> cq.log_cqes) & 1u)) return false;
  const uint32_t sop_drop_qpn = be32(uint32_t(tail));
  out->wqe_opcode = uint8_t(sop_drop_qpn >> 24);
  out->qpn = sop_drop_qpn & 0xffffffu;
  out->wqe_counter = be16(uint16_t(tail >> 32));
  out->cqe_opcode = op_own >> 4;
  out->owner = op_own & 1u;
  out->byte_count = be32(uint32_t(load_u64(e + 40) >> 32));
  out->syndrome = uint8_t(load_u64(e + 48) >> 56);
  return true;
}

DC_HD void cq_set_consumer_index(const CqRing& cq, uint32_t ci) { store_release_u32(cq.dbrec, be32(ci & 0xffffffu)); }
DC_HD uint32_t cq_consumer_index(const CqRing& cq) { return be32(load_acquire_u32(cq.dbrec)) & 0xffffffu; }

// Free CQEs from the NIC's point of view, with 24-bit consumer indices.
DC_HD uint32_t cq_room(const CqRing& cq, uint32_t pi) {
  return cq.size() - ((pi - cq_consumer_index(cq)) & 0xffffffu);
}

}  // namespace dc::transport
