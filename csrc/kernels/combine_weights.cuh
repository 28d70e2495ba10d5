// A combined token's weights: lane k < topk sums weight k over the ranks holding the token, ranks ascending (our
// own from topk_weights, a peer's from its staging row), as the reference does. Shared by both reducer kinds.
#pragma once
#include <cstdint>

#include "api.hpp"

namespace dc {

#if defined(__CUDACC__)
__device__ __forceinline__ void reduce_token_weights(const CombineArgs& a, int t, uint32_t holders, int R, int rank,
                                                     int64_t own_row, const uint8_t* stage_rows,
                                                     int64_t stage_stride, int64_t w_off, int lane) {
  if (a.out_weights == nullptr || lane >= a.topk) return;
  float w = 0.0f;
  for (int s = 0; s < R; ++s) {
    if (!((holders >> s) & 1u)) continue;
    w += s == rank ? a.topk_weights[own_row * a.topk + lane]
                   : reinterpret_cast<const volatile float*>(stage_rows + s * stage_stride + w_off)[lane];
  }
  a.out_weights[int64_t(t) * a.topk + lane] = w;
}
#endif

}  // namespace dc
