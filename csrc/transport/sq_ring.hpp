// The send queue as memory: a ring of 2^n WQEBBs, the doorbell record and the doorbell (BlueFlame) register.
//
// Indices are free-running WQEBB counters. The producer index (pi) counts WQEBBs posted, the NIC's consumer
// index (ci) WQEBBs consumed; WQEBB i lives at slot i & (size - 1), and a WQE that runs past the ring's end
// continues at slot 0 (rdma-core wraps segments at the queue end the same way). Only the low 16 bits travel:
// the doorbell record holds them and the NIC compares 16-bit values, so a ring has at most 2^15 WQEBBs.
//
// Posting (rdma-core post_send / NVSHMEM ibgda_update_dbr + ibgda_ring_db):
//   1. write the WQEs;
//   2. dbrec[MLX5_SND_DBR = 1] = big-endian (pi & 0xffff), with release ordering (WQEs visible first);
//   3. store 8 bytes to the doorbell register: the first 8 bytes of a control segment carrying pi and the QPN.
// The NIC trusts the doorbell record; the register write only tells it to look.
#pragma once
#include <cstdint>

#include "mlx5_wqe.hpp"

namespace dc::transport {

constexpr uint32_t kMaxLogWqebbs = 15;
constexpr int kSndDbr = 1;  // MLX5_SND_DBR: word 1 of the QP's doorbell record (word 0 is the receive queue's)

struct SqRing {
  uint8_t* wqes;         // 2^log_wqebbs WQEBBs, 64-byte aligned
  uint32_t log_wqebbs;
  uint32_t qpn;          // 24 bits

  DC_HD uint32_t wqebbs() const { return 1u << log_wqebbs; }
  // The k-th 16-byte segment of the WQE whose first WQEBB is `wqe_index`, wrapping at the ring's end.
  DC_HD uint8_t* seg(uint32_t wqe_index, uint32_t k) const {
    const uint32_t ring_mask = (wqebbs() << kWqebbShift) - 1;
    return wqes + (((wqe_index << kWqebbShift) + k * kSegBytes) & ring_mask);
  }
};

struct SqDoorbell {
  uint32_t* dbrec;  // the QP's two-word doorbell record
  uint64_t* reg;    // the doorbell register (a UAR page on a NIC; plain memory for the emulated NIC)
};

// What dbrec[1] holds after posting up to producer index pi.
DC_HD uint32_t dbrec_value(uint32_t pi) { return be32(pi & 0xffffu); }

// The 8 bytes written to the doorbell register: opmod_idx_opcode with pi as the index (opcode 0) and qpn_ds with
// the QPN (ds 0), as NVSHMEM's ibgda_ring_db does, as one little-endian word.
DC_HD uint64_t doorbell_value(uint32_t pi, uint32_t qpn) {
  return uint64_t(be32(pack_opmod_idx_opcode(0, pi, 0))) | (uint64_t(be32(pack_qpn_ds(qpn, 0))) << 32);
}

// Steps 2 and 3 above: the WQEs up to pi become visible to the NIC.
DC_HD void ring_doorbell(const SqDoorbell& db, uint32_t pi, uint32_t qpn) {
  store_release_u32(db.dbrec + kSndDbr, dbrec_value(pi));
  store_release_u64(db.reg, doorbell_value(pi, qpn));
}

// The NIC's view: the low 16 bits of the producer index.
DC_HD uint16_t read_producer_index(const uint32_t* dbrec) {
  return uint16_t(be32(load_acquire_u32(dbrec + kSndDbr)));
}

// WQEBBs posted but not consumed, from 16-bit indices.
DC_HD uint32_t wqebbs_pending(uint16_t pi, uint32_t ci) { return uint16_t(pi - uint16_t(ci)); }

}  // namespace dc::transport
