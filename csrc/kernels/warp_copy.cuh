// A warp copies n16 16-byte vectors, kUnroll loads in flight per lane before their stores (L1-bypassing stores to
// local or peer memory).
#pragma once
#include <cstdint>

#include "../../ptx/ptx.cuh"

namespace dc {

// kFresh: the source may have been written during this kernel (by a peer or a NIC, ordered by an acquire), so the
// loads must be coherent (ld.relaxed.gpu) instead of the non-coherent path.
template <int kUnroll, bool kFresh = false>
__device__ __forceinline__ void warp_copy_v4(const int4* src, int4* dst, int64_t n16, int lane) {
  for (int64_t i0 = lane; i0 < n16; i0 += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i0 + u * 32 < n16)
        v[u] = kFresh ? ptx::ld_relaxed_gpu_v4(src + i0 + u * 32) : ptx::ld_nc_na_v4(src + i0 + u * 32);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i0 + u * 32 < n16) ptx::st_na_v4(dst + i0 + u * 32, v[u]);
  }
}

}  // namespace dc
