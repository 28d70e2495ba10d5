// Eight bf16 values in one 16-byte vector, as the kernels load them, to fp32 (exact).
#pragma once
#include <cuda_bf16.h>

namespace dc {

__device__ __forceinline__ void unpack_bf16x8(const int4& v, float (&f)[8]) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 p = __bfloat1622float2(h[j]);
    f[2 * j] = p.x;
    f[2 * j + 1] = p.y;
  }
}

}  // namespace dc
