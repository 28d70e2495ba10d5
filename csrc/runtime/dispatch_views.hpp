// The typed views of one normal dispatch's output block (DispatchOutLayout, nvl_layout.hpp): which of x, scales,
// topk_idx and topk_weights a call returns, with their shapes and DLPack types. Both the call that launches into
// an arena block and the host's carving of the bounce area use it, so the block's layout is read in one place.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "arena_core.hpp"
#include "nvl_layout.hpp"

namespace dc {

// A DLPack element type packed as code << 8 | bits: how the Python side names an output's dtype in one int.
inline dlpack::DataType unpack_dlpack_type(int packed) {
  return dlpack::DataType{uint8_t((packed >> 8) & 0xff), uint8_t(packed & 0xff), 1};
}

struct DispatchOutputs {
  int x_type = 0;               // packed DLPack type of x's elements
  int64_t x_row_bytes = 0;
  int scale_type = 0;           // packed type of the scales' elements (unused without scales)
  int64_t scale_row_bytes = 0;  // 0: no scales
  int64_t topk = 0;             // K: the topk_idx / topk_weights columns (and the block's carving)
  bool with_idx = false, with_weights = false;
};

// The views of n rows, in output order, and each output's index among them (-1: not returned).
struct DispatchViewSpecs {
  std::vector<ArenaViewSpec> specs;
  int slot[4] = {-1, -1, -1, -1};  // x, scales, topk_idx, topk_weights
};

inline int64_t columns_of(int64_t row_bytes, dlpack::DataType t, const char* what) {
  const int64_t elem = t.bits / 8;
  if (t.bits == 0 || t.bits % 8 != 0 || row_bytes % elem != 0)
    throw std::invalid_argument(std::string("dispatch views: ") + what + " rows are not whole elements");
  return row_bytes / elem;
}

inline DispatchViewSpecs dispatch_view_specs(const DispatchOutputs& o, int64_t n) {
  const DispatchOutLayout lay(n, o.x_row_bytes, o.scale_row_bytes, o.topk);
  DispatchViewSpecs v;
  auto add = [&](int slot, int64_t offset, int64_t cols, dlpack::DataType t) {
    v.slot[slot] = int(v.specs.size());
    v.specs.push_back(ArenaViewSpec{offset, 2, {n, cols, 0, 0}, t});
  };
  const dlpack::DataType xt = unpack_dlpack_type(o.x_type);
  add(0, lay.x, columns_of(o.x_row_bytes, xt, "x"), xt);
  if (o.scale_row_bytes > 0) {
    const dlpack::DataType st = unpack_dlpack_type(o.scale_type);
    add(1, lay.scales, columns_of(o.scale_row_bytes, st, "scales"), st);
  }
  if (o.with_idx) add(2, lay.topk_idx, o.topk, dlpack::DataType{dlpack::kInt, 64, 1});
  if (o.with_weights) add(3, lay.topk_weights, o.topk, dlpack::DataType{dlpack::kFloat, 32, 1});
  return v;
}

}  // namespace dc
