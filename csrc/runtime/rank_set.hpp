// A set of ranks, one bit each, that kernels keep in registers: low-latency mode's live ranks (up to kLlMaxRanks,
// csrc/runtime/ll_layout.hpp). Each access touches every word (see word()).
#pragma once
#include <cstdint>

namespace dc {

template <int kMaxRanks>
struct RankSet {
  static_assert(kMaxRanks > 0 && kMaxRanks % 32 == 0, "whole 32-bit words");
  static constexpr int kWords = kMaxRanks / 32;
  uint32_t w[kWords];  // bit r % 32 of word r / 32: rank r

  // Every word is touched in each access, each masked by whether it is the one wanted: written as `if (j == i)`
  // the compiler folds the unrolled loop back into w[i], an indexed access that puts the array in local memory.
  __host__ __device__ uint32_t word(int i) const {
    uint32_t v = 0u;
#pragma unroll
    for (int j = 0; j < kWords; ++j) v |= w[j] & (0u - uint32_t(j == i));
    return v;
  }
  __host__ __device__ bool has(int r) const { return (word(r >> 5) >> (r & 31)) & 1u; }
  __host__ __device__ void add(int r) {
#pragma unroll
    for (int j = 0; j < kWords; ++j) w[j] |= uint32_t(j == (r >> 5)) << (r & 31);
  }
  __host__ __device__ RankSet without(int r) const {
    RankSet s = *this;
#pragma unroll
    for (int j = 0; j < kWords; ++j) s.w[j] &= ~(uint32_t(j == (r >> 5)) << (r & 31));
    return s;
  }
};

// Every rank: normal mode's agreement, where no rank is masked.
struct AllRanks {
  __host__ __device__ bool has(int) const { return true; }
};

}  // namespace dc
