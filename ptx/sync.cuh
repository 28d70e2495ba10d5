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
// Bytes of dynamic shared memory this block was launched with.
DC_DEVICE uint32_t dynamic_smem_bytes() {
  uint32_t b;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(b));
  return b;
}
// Programmatic dependent launch (sm_90): a kernel launched with the programmatic-serialization attribute may
// start while the kernel before it in the stream still runs; grid_dependency_wait blocks until that kernel has
// completed and its memory is visible (a no-op when launched without the attribute), and
// launch_dependents lets the next such kernel start its blocks early.
DC_DEVICE void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
DC_DEVICE void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
#endif
}  // namespace dc::ptx
