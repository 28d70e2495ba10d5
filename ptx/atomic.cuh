// Atomics named after their semantics and scope.
#pragma once
#include "common.cuh"

namespace dc::ptx {
#if defined(__CUDACC__)
DC_DEVICE uint64_t atom_add_release_sys_u64(uint64_t* p, uint64_t v) {
  uint64_t old;
  asm volatile("atom.add.release.sys.global.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}
DC_DEVICE uint64_t atom_add_relaxed_gpu_u64(uint64_t* p, uint64_t v) {
  uint64_t old;
  asm volatile("atom.add.relaxed.gpu.global.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}
DC_DEVICE uint32_t atom_add_release_gpu_u32(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.add.release.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
DC_DEVICE uint32_t atom_cas_acquire_sys_u32(uint32_t* p, uint32_t cmp, uint32_t v) {
  uint32_t old;
  asm volatile("atom.cas.acquire.sys.global.b32 %0, [%1], %2, %3;" : "=r"(old) : "l"(p), "r"(cmp), "r"(v) : "memory");
  return old;
}
// GPU scope on a word in mapped host memory: its only writers are this GPU's threads, and x86 hosts have no
// native atomics over PCIe, so a system-scope atomic there is not allowed (compute-sanitizer flags it).
DC_DEVICE uint32_t atom_cas_acquire_gpu_u32(uint32_t* p, uint32_t cmp, uint32_t v) {
  uint32_t old;
  asm volatile("atom.cas.acquire.gpu.global.b32 %0, [%1], %2, %3;" : "=r"(old) : "l"(p), "r"(cmp), "r"(v) : "memory");
  return old;
}
DC_DEVICE uint32_t atom_cas_release_sys_u32(uint32_t* p, uint32_t cmp, uint32_t v) {
  uint32_t old;
  asm volatile("atom.cas.release.sys.global.b32 %0, [%1], %2, %3;" : "=r"(old) : "l"(p), "r"(cmp), "r"(v) : "memory");
  return old;
}
#endif
}  // namespace dc::ptx
