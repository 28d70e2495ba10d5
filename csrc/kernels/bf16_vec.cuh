// Eight bf16 values in one 16-byte vector, as the kernels load and store them: to fp32 (exact), and from fp32
// (each rounded to nearest even), and added into fp32 sums.
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

// acc[j] += the vector's value j.
__device__ __forceinline__ void accumulate_bf16x8(float* acc, const int4& v) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(h[j]);
    acc[2 * j] += f.x;
    acc[2 * j + 1] += f.y;
  }
}

__device__ __forceinline__ int4 round_bf16x8(const float* acc) {
  int4 out;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
  return out;
}

}  // namespace dc
