// Build WQEs in the send ring: what a GPU thread (or a CPU poster) calls before ringing the doorbell.
// Each encoder writes whole 16-byte segments at `wqe_index` and returns the WQEBBs the WQE takes. Bytes past the
// last segment of a WQEBB are left as they are: the NIC reads only ds segments.
#pragma once
#include <cstdint>

#include "sq_ring.hpp"

namespace dc::transport {

struct WqeCtrl {
  uint8_t fm_ce_se = kCtrlCqUpdate;  // signaled by default
  uint8_t signature = 0;
  uint32_t imm = 0;                  // host order; sent only by RDMA_WRITE_IMM
};

struct RdmaWrite {
  uint64_t laddr;  // local source, named by (lkey, laddr)
  uint32_t lkey;
  uint64_t raddr;  // remote destination, named by (rkey, raddr)
  uint32_t rkey;
  uint32_t bytes;
};

struct FetchAdd {
  uint64_t laddr;  // where the old remote value lands (8 bytes)
  uint32_t lkey;
  uint64_t raddr;  // the remote 8-byte counter
  uint32_t rkey;
  uint64_t add;
};

DC_HD void encode_ctrl(const SqRing& sq, uint32_t wqe_index, uint8_t opcode, uint8_t opmod, uint32_t ds,
                       const WqeCtrl& c) {
  const uint64_t lo = uint64_t(be32(pack_opmod_idx_opcode(opmod, wqe_index, opcode))) |
                      (uint64_t(be32(pack_qpn_ds(sq.qpn, ds))) << 32);
  const uint64_t hi = uint64_t(c.signature) | (uint64_t(c.fm_ce_se) << 24) | (uint64_t(be32(c.imm)) << 32);
  store_seg(sq.seg(wqe_index, 0), lo, hi);
}

DC_HD void encode_raddr(uint8_t* seg, uint64_t raddr, uint32_t rkey) {
  store_seg(seg, be64(raddr), uint64_t(be32(rkey)));
}

DC_HD void encode_data(uint8_t* seg, uint32_t bytes, uint32_t lkey, uint64_t laddr) {
  store_seg(seg, uint64_t(be32(bytes)) | (uint64_t(be32(lkey)) << 32), be64(laddr));
}

DC_HD uint32_t encode_rdma_write(const SqRing& sq, uint32_t wqe_index, const RdmaWrite& w, const WqeCtrl& c = {},
                                 bool with_imm = false) {
  encode_ctrl(sq, wqe_index, with_imm ? kOpRdmaWriteImm : kOpRdmaWrite, 0, kDsRdmaWrite, c);
  encode_raddr(sq.seg(wqe_index, 1), w.raddr, w.rkey);
  encode_data(sq.seg(wqe_index, 2), w.bytes, w.lkey, w.laddr);
  return wqebbs_of_ds(kDsRdmaWrite);
}

DC_HD uint32_t encode_fetch_add(const SqRing& sq, uint32_t wqe_index, const FetchAdd& a, const WqeCtrl& c = {}) {
  encode_ctrl(sq, wqe_index, kOpAtomicFetchAdd, 0, kDsFetchAdd, c);
  encode_raddr(sq.seg(wqe_index, 1), a.raddr, a.rkey);
  store_seg(sq.seg(wqe_index, 2), be64(a.add), 0);  // compare is unused by fetch-add
  encode_data(sq.seg(wqe_index, 3), 8, a.lkey, a.laddr);
  return wqebbs_of_ds(kDsFetchAdd);
}

// Inline write: the payload travels inside the WQE (no lkey), after a 4-byte header big-endian(bytes | INLINE).
// Requires bytes <= kMaxInlineBytes. The last segment is zero-padded.
DC_HD uint32_t encode_rdma_write_inline(const SqRing& sq, uint32_t wqe_index, const void* payload, uint32_t bytes,
                                        uint64_t raddr, uint32_t rkey, const WqeCtrl& c = {}) {
  const uint32_t ds = ds_inline_write(bytes);
  encode_ctrl(sq, wqe_index, kOpRdmaWrite, 0, ds, c);
  encode_raddr(sq.seg(wqe_index, 1), raddr, rkey);
  const uint32_t header = be32(bytes | kInlineSegFlag);
  const auto* src = static_cast<const uint8_t*>(payload);
  for (uint32_t k = 2; k < ds; ++k) {  // one 16-byte segment at a time: a segment never straddles the ring's end
    uint8_t chunk[kSegBytes] = {};
    for (uint32_t b = 0; b < kSegBytes; ++b) {
      const uint32_t pos = (k - 2) * kSegBytes + b;  // position in header + payload
      if (pos < kInlineHeaderBytes) chunk[b] = uint8_t(header >> (8 * pos));
      else if (pos - kInlineHeaderBytes < bytes) chunk[b] = src[pos - kInlineHeaderBytes];
    }
    uint64_t lo, hi;
    memcpy(&lo, chunk, 8);
    memcpy(&hi, chunk + 8, 8);
    store_seg(sq.seg(wqe_index, k), lo, hi);
  }
  return wqebbs_of_ds(ds);
}

}  // namespace dc::transport
