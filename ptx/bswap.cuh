// Byte swaps for big-endian wire formats (mlx5 WQE fields, doorbell records).
// The device versions use prmt; the host twins are plain C++ and are what host tests compare against.
#pragma once
#include "common.cuh"

namespace dc::ptx {

inline constexpr uint16_t bswap16_host(uint16_t v) { return uint16_t((v >> 8) | (v << 8)); }
inline constexpr uint32_t bswap32_host(uint32_t v) {
  return (v >> 24) | ((v >> 8) & 0x0000ff00u) | ((v << 8) & 0x00ff0000u) | (v << 24);
}
inline constexpr uint64_t bswap64_host(uint64_t v) {
  return (uint64_t(bswap32_host(uint32_t(v))) << 32) | bswap32_host(uint32_t(v >> 32));
}

// Selector 0x4401: result byte 0 = source byte 1, byte 1 = source byte 0, bytes 2-3 = zero (from the 0 operand).
DC_HOST_DEVICE uint16_t bswap16(uint16_t v) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("prmt.b32 %0, %1, 0, 0x4401;" : "=r"(r) : "r"(uint32_t(v)));
  return uint16_t(r);
#else
  return bswap16_host(v);
#endif
}

DC_HOST_DEVICE uint32_t bswap32(uint32_t v) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("prmt.b32 %0, %1, 0, 0x0123;" : "=r"(r) : "r"(v));
  return r;
#else
  return bswap32_host(v);
#endif
}

DC_HOST_DEVICE uint64_t bswap64(uint64_t v) {
#if defined(__CUDA_ARCH__)
  uint32_t lo = uint32_t(v), hi = uint32_t(v >> 32), rlo, rhi;
  asm("prmt.b32 %0, %1, 0, 0x0123;" : "=r"(rlo) : "r"(hi));
  asm("prmt.b32 %0, %1, 0, 0x0123;" : "=r"(rhi) : "r"(lo));
  return (uint64_t(rhi) << 32) | rlo;
#else
  return bswap64_host(v);
#endif
}
}  // namespace dc::ptx
