// Read a WQE back out of the send ring: what the emulated NIC (GPU or CPU proxy) does after the doorbell.
// decode_wqe(encode_*(...)) gives back every field the encoder took, in host order.
#pragma once
#include <cstdint>

#include "sq_ring.hpp"

namespace dc::transport {

enum DecodeStatus : uint8_t {
  kDecodeOk = 0,
  kDecodeBadOpcode = 1,  // not one of the opcodes this NIC executes
  kDecodeBadSize = 2,    // ds does not match the opcode's segments
};

struct DecodedWqe {
  // control segment
  uint8_t opcode;
  uint8_t opmod;
  uint16_t wqe_index;
  uint32_t qpn;
  uint32_t ds;
  uint8_t signature;
  uint8_t fm_ce_se;
  uint32_t imm;
  // remote-address segment
  uint64_t raddr;
  uint32_t rkey;
  // data segment (writes, and the fetch-add's result buffer); for an inline write, bytes is the payload length
  uint64_t laddr;
  uint32_t lkey;
  uint32_t bytes;
  bool is_inline;
  // atomic segment
  uint64_t add;
  uint64_t compare;

  DC_HD uint32_t wqebbs() const { return wqebbs_of_ds(ds); }
};

DC_HD void decode_ctrl(const SqRing& sq, uint32_t wqe_index, DecodedWqe* w) {
  const uint8_t* s = sq.seg(wqe_index, 0);
  const uint64_t lo = load_u64(s), hi = load_u64(s + 8);
  const uint32_t opmod_idx_opcode = be32(uint32_t(lo)), qpn_ds = be32(uint32_t(lo >> 32));
  w->opcode = uint8_t(opmod_idx_opcode);
  w->wqe_index = uint16_t(opmod_idx_opcode >> 8);
  w->opmod = uint8_t(opmod_idx_opcode >> 24);
  w->qpn = qpn_ds >> 8;
  w->ds = qpn_ds & 0xffu;
  w->signature = uint8_t(hi);
  w->fm_ce_se = uint8_t(hi >> 24);
  w->imm = be32(uint32_t(hi >> 32));
}

DC_HD void decode_raddr(const uint8_t* s, DecodedWqe* w) {
  w->raddr = be64(load_u64(s));
  w->rkey = be32(uint32_t(load_u64(s + 8)));
}

DC_HD void decode_data(const uint8_t* s, DecodedWqe* w) {
  const uint64_t lo = load_u64(s);
  w->bytes = be32(uint32_t(lo));
  w->lkey = be32(uint32_t(lo >> 32));
  w->laddr = be64(load_u64(s + 8));
}

DC_HD DecodeStatus decode_wqe(const SqRing& sq, uint32_t wqe_index, DecodedWqe* w) {
  *w = DecodedWqe{};
  decode_ctrl(sq, wqe_index, w);
  if (w->ds < 2 || w->wqebbs() > kMaxWqebbsPerWqe) return kDecodeBadSize;
  switch (w->opcode) {
    case kOpRdmaWrite:
    case kOpRdmaWriteImm: {
      decode_raddr(sq.seg(wqe_index, 1), w);
      const uint8_t* s = sq.seg(wqe_index, 2);
      const uint32_t first = be32(uint32_t(load_u64(s)));
      w->is_inline = (first & kInlineSegFlag) != 0;
      if (w->is_inline) {
        w->bytes = first & ~kInlineSegFlag;
        return w->bytes <= kMaxInlineBytes && w->ds == ds_inline_write(w->bytes) ? kDecodeOk : kDecodeBadSize;
      }
      decode_data(s, w);
      return w->ds == kDsRdmaWrite ? kDecodeOk : kDecodeBadSize;
    }
    case kOpAtomicFetchAdd: {
      if (w->ds != kDsFetchAdd) return kDecodeBadSize;
      decode_raddr(sq.seg(wqe_index, 1), w);
      const uint8_t* a = sq.seg(wqe_index, 2);
      w->add = be64(load_u64(a));
      w->compare = be64(load_u64(a + 8));
      decode_data(sq.seg(wqe_index, 3), w);
      return kDecodeOk;
    }
    default:
      return kDecodeBadOpcode;
  }
}

// Copy an inline write's payload out of the ring (it may continue past the ring's end at slot 0).
DC_HD void copy_inline_payload(const SqRing& sq, uint32_t wqe_index, uint8_t* dst, uint32_t bytes) {
  for (uint32_t i = 0; i < bytes; ++i) {
    const uint32_t pos = kInlineHeaderBytes + i;
    dst[i] = sq.seg(wqe_index, 2 + pos / kSegBytes)[pos % kSegBytes];
  }
}

}  // namespace dc::transport
