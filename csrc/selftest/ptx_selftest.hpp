// What the ptx/ self-test kernel reports; compared with plain C++/Python twins by tests/runtime/test_ptx.py.
#pragma once
#include <cstdint>

namespace dc {

constexpr int kSelftestValues = 32;
constexpr int kSelftestVectors = 96;
constexpr int kSelftestThreads = 128;

struct PtxSelftest {
  uint32_t bswap32[kSelftestValues];
  uint64_t bswap64[kSelftestValues];
  uint64_t acquire_sys, acquire_gpu, relaxed_sys, na_u64;
  uint32_t acquire_sys_u32;
  int volatile_s32;
  uint64_t add_sys, add_gpu;  // sum of 1..kSelftestThreads
  uint32_t add_gpu_u32;
  uint32_t cas_old_first, cas_old_second, cas_final;
  uint32_t lanemask_lt[32];
  uint64_t named_barrier_seen;
  int copy_match;  // 0 when every 16-byte copy flavour and the bulk copy moved the bytes unchanged
  int timer_advanced;
};

// Runs the kernel on the current device with kSelftestValues inputs.
PtxSelftest run_ptx_selftest(const uint64_t* values);

}  // namespace dc
