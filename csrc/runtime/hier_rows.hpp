// The rows of the hierarchical internode kernels (kernels/hier_kernels.hpp), described once for the host and the
// kernels: the layout of a dispatch row and of a combine's held row, and the word functions that build a row from
// the caller's tensors and split a received row into the output tensors. The kernels call them for every word
// past the leading x vectors (which they copy 16 bytes at a time); deepcomm._selftest runs the same functions on
// host memory (tests/internode/test_hier_rows_host.py) against the torch packing of deepcomm/internode/hier_normal.py.
//
// Every part's row is a whole number of 4-byte words, so a row is built and split word by word.
#pragma once
#include <cstdint>

#include "host_device.hpp"
#include "nvl_layout.hpp"

namespace dc {

// A dispatch row (the bytes one token travels as, over both hops), the parts side by side from byte 0, as the
// reference backend sends them:
//   x [x_bytes] | scales [scale_bytes] | (with_idx) top-k ids int64 [K] | source token index int32 |
//   (with_weights) top-k weights fp32 [K] | (gpus > 1) node GPU mask int32 at mask_off | zeros to stride (% 16)
// Offsets are -1 for a part the row does not have.
struct HierDispatchRow {
  int64_t x_bytes, scale_bytes, topk;
  int64_t scale_off, idx_off, src_off, w_off, mask_off, stride;
  bool has_mask;
  DC_HD HierDispatchRow() : HierDispatchRow(0, 0, 0, false, false, 1) {}
  DC_HD HierDispatchRow(int64_t x_row_bytes, int64_t scale_row_bytes, int64_t k, bool with_idx, bool with_weights,
                        int gpus)
      : x_bytes(x_row_bytes), scale_bytes(scale_row_bytes), topk(k), has_mask(gpus > 1) {
    int64_t off = x_bytes;
    scale_off = scale_bytes > 0 ? off : -1;
    off += scale_bytes;
    idx_off = with_idx ? off : -1;
    off += with_idx ? 8 * topk : 0;
    src_off = with_idx ? off : -1;
    off += with_idx ? 4 : 0;
    w_off = with_weights ? off : -1;
    off += with_weights ? 4 * topk : 0;
    mask_off = align_up(off, 4);
    stride = align_up(mask_off + (has_mask ? 4 : 0), 16);
  }
};

// The caller's tensors a dispatch row is built from (row-major and contiguous; null for a part the row lacks).
struct HierRowSrc {
  const uint8_t* x;          // [T][x_bytes]
  const uint8_t* scales;     // [T][scale_bytes]
  const int64_t* topk_idx;   // [T][K]
  const float* weights;      // [T][K]
};

// Where a received row's parts go (row-major; null for a part not wanted).
// With local_experts > 0 and ids in the row, the top-k slots are split by dispatch_unpack_slot instead: the ids
// become the receiver's local ids (e - first_expert where that is in [0, local_experts), else -1) and the weights
// of the other slots +0, as the reference backend returns them (deepcomm/layout.py to_local_experts).
struct HierRecvDst {
  uint8_t* x;                // [n][x_bytes]
  uint8_t* scales;           // [n][scale_bytes]
  int64_t* topk_idx;         // [n][K]
  int32_t* src_idx;          // [n]
  float* weights;            // [n][K]
  int64_t first_expert = 0;  // the receiver's first expert: rank * local_experts
  int64_t local_experts = 0;  // 0: ids and weights as they travelled
};

DC_HD bool dispatch_unpacks_slots(const HierDispatchRow& r, const HierRecvDst& d) {
  return d.local_experts > 0 && r.idx_off >= 0;
}

DC_HD uint32_t load_word(const void* base, int64_t byte) {
  return *reinterpret_cast<const uint32_t*>(reinterpret_cast<const uint8_t*>(base) + byte);
}

DC_HD void store_word(void* base, int64_t byte, uint32_t v) {
  *reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(base) + byte) = v;
}

// Word `o / 4` (o % 4 == 0, o < stride) of token `tok`'s row, whose node GPU mask is `mask`.
DC_HD uint32_t dispatch_row_word(const HierDispatchRow& r, const HierRowSrc& s, int64_t tok, int64_t o,
                                 uint32_t mask) {
  if (o < r.x_bytes) return load_word(s.x, tok * r.x_bytes + o);
  if (r.scale_off >= 0 && o < r.scale_off + r.scale_bytes)
    return load_word(s.scales, tok * r.scale_bytes + o - r.scale_off);
  if (r.idx_off >= 0 && o >= r.idx_off && o < r.idx_off + 8 * r.topk)
    return load_word(s.topk_idx, tok * 8 * r.topk + o - r.idx_off);
  if (o == r.src_off) return uint32_t(tok);
  if (r.w_off >= 0 && o >= r.w_off && o < r.w_off + 4 * r.topk)
    return load_word(s.weights, tok * 4 * r.topk + o - r.w_off);
  if (r.has_mask && o == r.mask_off) return mask;
  return 0u;
}

// Word `o / 4` of received row `i`, `v`, into its output (the mask and the padding go nowhere).
DC_HD void dispatch_unpack_word(const HierDispatchRow& r, const HierRecvDst& d, int64_t i, int64_t o, uint32_t v) {
  if (o < r.x_bytes) {
    store_word(d.x, i * r.x_bytes + o, v);
  } else if (r.scale_off >= 0 && o < r.scale_off + r.scale_bytes) {
    store_word(d.scales, i * r.scale_bytes + o - r.scale_off, v);
  } else if (r.idx_off >= 0 && o >= r.idx_off && o < r.idx_off + 8 * r.topk) {
    if (d.topk_idx != nullptr && !dispatch_unpacks_slots(r, d))
      store_word(d.topk_idx, i * 8 * r.topk + o - r.idx_off, v);
  } else if (o == r.src_off) {
    if (d.src_idx != nullptr) d.src_idx[i] = int32_t(v);
  } else if (r.w_off >= 0 && o >= r.w_off && o < r.w_off + 4 * r.topk) {
    if (d.weights != nullptr && !dispatch_unpacks_slots(r, d))
      store_word(d.weights, i * 4 * r.topk + o - r.w_off, v);
  }
}

// Top-k slot k of received row i (with dispatch_unpacks_slots): its id from the row's two words at idx_off + 8k
// (low, high) and its weight word at w_off + 4k (0 when the row has none), as the receiver's local id and masked
// weight.
DC_HD void dispatch_unpack_slot(const HierDispatchRow& r, const HierRecvDst& d, int64_t i, int64_t k, uint32_t id_lo,
                                uint32_t id_hi, uint32_t weight) {
  const int64_t e = int64_t((uint64_t(id_hi) << 32) | uint64_t(id_lo));
  const int64_t local = e - d.first_expert;
  const bool mine = e >= 0 && local >= 0 && local < d.local_experts;
  if (d.topk_idx != nullptr) d.topk_idx[i * r.topk + k] = mine ? local : -1;
  if (r.w_off >= 0 && d.weights != nullptr) store_word(d.weights, (i * r.topk + k) * 4, mine ? weight : 0u);
}

// A combine's held row (what a holder sends for a token it holds: over NVLink to the token's forwarder, and as is
// over RDMA when it is the token's only holder on its node):
//   x: bf16 [H], or with fp8 e4m3 [H] then fp32 scales [H/128] | zeros to w_off (% 4) | fp32 weights [K] at w_off |
//   zeros to stride (% 16)
struct HierHeldRow {
  int64_t x_bytes, w_off, stride;
  DC_HD HierHeldRow(int64_t hidden, int64_t topk, bool fp8)
      : x_bytes(fp8 ? hidden + hidden / 128 * 4 : 2 * hidden),
        w_off(align_up(x_bytes, 4)),
        stride(align_up(w_off + 4 * topk, 16)) {}
};

// Word `o / 4` (x_bytes <= o < stride) of held row `j`: a weight of `weights` [..][K] row j, else zero.
DC_HD uint32_t held_row_tail_word(const HierHeldRow& r, const float* weights, int64_t topk, int64_t j, int64_t o) {
  if (weights != nullptr && o >= r.w_off && o < r.w_off + 4 * topk)
    return load_word(weights, j * 4 * topk + o - r.w_off);
  return 0u;
}

}  // namespace dc
