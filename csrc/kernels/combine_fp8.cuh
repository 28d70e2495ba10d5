// The FP8 wire format of the normal combine (off by default): a row a sender stores into a peer's staging slot is
//   e4m3 [H] | fp32 scales [H/128] | fp32 weights [K]     (combine_fp8_row_bytes, csrc/runtime/nvl_layout.hpp)
// quantized per 128-element block with the rule of deepcomm/fp8.py; the receiver dequantizes (one fp32 multiply
// per element, never fused into the add) and accumulates in fp32 exactly like a BF16 row.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "../../ptx/ptx.cuh"
#include "bf16_vec.cuh"
#include "fp8_cast.cuh"

namespace dc {

// A warp quantizes one bf16 row of n16 16-byte vectors (n16 % 16 == 0, i.e. H % 128 == 0) into dst, kUnroll
// vectors in flight per lane. Lane l of iteration `base` owns vector base + u*32 + l; sixteen consecutive vectors
// form one 128-element block, so each half-warp is wholly inside or outside the row.
template <int kUnroll>
__device__ __forceinline__ void warp_store_row_e4m3(const int4* src, uint8_t* dst, int64_t n16, int lane) {
  auto* values = reinterpret_cast<uint64_t*>(dst);                // 8 e4m3 bytes per source vector
  auto* scales = reinterpret_cast<uint32_t*>(dst + n16 * 8);      // one fp32 per 16 source vectors
  for (int64_t base = 0; base < n16; base += 32 * kUnroll) {      // same trip count on every lane: shuffles inside
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      v[u] = i < n16 ? ptx::ld_nc_na_v4(src + i) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * 32 + lane;
      float f[8];
      unpack_bf16x8(v[u], f);
      float scale;
      const uint2 q = quantize8_e4m3(f, false, &scale);
      if (i < n16) {
        ptx::st_na_u64(values + i, (uint64_t(q.y) << 32) | q.x);
        if ((lane & 15) == 0) ptx::st_na_u32(scales + i / 16, __float_as_uint(scale));
      }
    }
  }
}

// f[j] = e4m3 value j of q times scale, j = 0..7 (byte j of q, little-endian; e4m3 -> half is exact); each product
// is rounded on its own (__fmul_rn is never contracted into an FMA), as the reference's dequantize.
__device__ __forceinline__ void dequant_e4m3x8(const uint2& q, float scale, float (&f)[8]) {
  const uint32_t words[2] = {q.x, q.y};
#pragma unroll
  for (int w = 0; w < 2; ++w)
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const auto pair = static_cast<__nv_fp8x2_storage_t>((words[w] >> (16 * p)) & 0xffffu);
      const float2 v = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
      f[4 * w + 2 * p] = __fmul_rn(v.x, scale);
      f[4 * w + 2 * p + 1] = __fmul_rn(v.y, scale);
    }
}

// acc[j] += the dequantized value j: the sum matches the reference's dequantize-then-add.
__device__ __forceinline__ void accumulate_e4m3x8(float* acc, const uint2& q, float scale) {
  float f[8];
  dequant_e4m3x8(q, scale, f);
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] += f[j];
}

}  // namespace dc
