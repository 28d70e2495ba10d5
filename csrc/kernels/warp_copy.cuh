// A warp copies n16 16-byte vectors, kUnroll loads in flight per lane before their stores (non-coherent loads of
// data nobody writes during the kernel, L1-bypassing stores to local or peer memory).
#pragma once
#include <cstdint>

#include "../../ptx/ptx.cuh"

namespace dc {

template <int kUnroll>
__device__ __forceinline__ void warp_copy_v4(const int4* src, int4* dst, int64_t n16, int lane) {
  for (int64_t i0 = lane; i0 < n16; i0 += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i0 + u * 32 < n16) v[u] = ptx::ld_nc_na_v4(src + i0 + u * 32);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i0 + u * 32 < n16) ptx::st_na_v4(dst + i0 + u * 32, v[u]);
  }
}

}  // namespace dc
