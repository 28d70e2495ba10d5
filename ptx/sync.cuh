// Named barriers (a subset of a block's warps), warp lane masks and the global nanosecond timer.
#pragma once
#include "common.cuh"

namespace dc::ptx {
#if defined(__CUDACC__)
// bar.sync with an id other than 0 lets one role (a group of warps) sync without stalling the others.
DC_DEVICE void named_barrier_sync(int id, int num_threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(num_threads) : "memory");
}
DC_DEVICE uint32_t lanemask_lt() {
  uint32_t m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}
// Nanoseconds since an arbitrary origin, the same on every SM of a GPU; used for wait timeouts.
DC_DEVICE uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif
}  // namespace dc::ptx
