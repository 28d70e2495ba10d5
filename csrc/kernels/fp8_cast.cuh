// Per-token 1x128 e4m3 quantization inside a warp, bit-exact with deepcomm/fp8.py:
//   amax = max(max|x|, 1e-4); scale = amax / 448 (IEEE); UE8M0: exponent + 1 when any mantissa bit is set;
//   value = e4m3_satfinite(x / scale) (IEEE division, round to nearest even).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace dc {

__device__ __forceinline__ float ue8m0_round_up(float scale) {
  uint32_t bits = __float_as_uint(scale);
  const uint32_t exponent = (bits >> 23) & 0xffu;
  const uint32_t up = ((bits & 0x7fffffu) != 0u && exponent != 0xffu) ? 1u : 0u;
  return __uint_as_float((exponent + up) << 23);
}

// 128 / N lanes quantize one 128-element block: each lane holds N (8 or 16) consecutive elements as fp32 and gets
// back their N e4m3 bytes (packed little-endian, 4 per word) and the block's scale. Every lane of the warp must call
// it (the amax reduction shuffles within each group of 128 / N lanes); lanes past the row pass zeros and ignore the
// result.
template <int N>
__device__ __forceinline__ void quantize_e4m3(const float (&v)[N], bool use_ue8m0, float* scale_out,
                                              uint32_t (&packed)[N / 4]) {
  static_assert(N == 8 || N == 16, "8 or 16 elements per lane");
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < N; ++j) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
  for (int off = 64 / N; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  amax = fmaxf(amax, 1e-4f);
  float scale = __fdiv_rn(amax, 448.0f);
  if (use_ue8m0) scale = ue8m0_round_up(scale);
#pragma unroll
  for (int w = 0; w < N / 4; ++w) packed[w] = 0u;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(__fdiv_rn(v[j], scale), __NV_SATFINITE, __NV_E4M3);
    packed[j / 4] |= uint32_t(q) << (8 * (j % 4));
  }
  *scale_out = scale;
}

// Half a warp per 128-element block, 8 elements per lane (quantize_e4m3<8>).
__device__ __forceinline__ uint2 quantize8_e4m3(const float (&v)[8], bool use_ue8m0, float* scale_out) {
  uint32_t packed[2];
  quantize_e4m3<8>(v, use_ue8m0, scale_out, packed);
  return make_uint2(packed[0], packed[1]);
}

}  // namespace dc
