// The few memory operations the transport needs, written once for host and device: acquire/release on the
// doorbell record and CQE tails, the 64-bit fetch-add of an atomic WQE, raw 16-byte segment stores.
// Device code goes through the ptx/ helpers; host code uses GCC atomics. That is what lets the same encoder,
// decoder and emulated NIC run in a CPU proxy thread today and inside a CUDA kernel later.
#pragma once
#include <cstdint>
#include <cstring>

#include "../../ptx/atomic.cuh"
#include "../../ptx/bswap.cuh"
#include "../../ptx/ld_st.cuh"
#include "../runtime/host_device.hpp"

namespace dc::transport {

DC_HD uint32_t load_acquire_u32(const uint32_t* p) {
#if defined(__CUDA_ARCH__)
  return ptx::ld_acquire_sys_u32(p);
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

DC_HD uint64_t load_acquire_u64(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
  return ptx::ld_acquire_sys_u64(p);
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

DC_HD void store_release_u32(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
  ptx::st_release_sys_u32(p, v);
#else
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

DC_HD void store_release_u64(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
  ptx::st_release_sys_u64(p, v);
#else
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

// Release: the RDMA writes the NIC executed before this atomic are visible to whoever sees its result.
DC_HD uint64_t fetch_add_release_u64(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
  return ptx::atom_add_release_sys_u64(p, v);
#else
  return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
#endif
}

// The posters' shared counters (device queue pairs, csrc/transport/qp_poster.hpp).
DC_HD uint32_t fetch_add_relaxed_u32(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
  return atomicAdd(p, v);
#else
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
#endif
}

// Returns the old value; on success (old == expected) later loads see what the last releaser of *p published.
DC_HD uint32_t cas_acquire_u32(uint32_t* p, uint32_t expected, uint32_t desired) {
#if defined(__CUDA_ARCH__)
  return ptx::atom_cas_acquire_sys_u32(p, expected, desired);
#else
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_ACQUIRE, __ATOMIC_ACQUIRE);
  return expected;
#endif
}

// WQE and CQE memory is read and written as 8-byte words (segments are 16-byte aligned).
DC_HD uint64_t load_u64(const uint8_t* p) { return *reinterpret_cast<const uint64_t*>(p); }
DC_HD void store_u64(uint8_t* p, uint64_t v) { *reinterpret_cast<uint64_t*>(p) = v; }
DC_HD void store_seg(uint8_t* p, uint64_t lo, uint64_t hi) {
  store_u64(p, lo);
  store_u64(p + 8, hi);
}

}  // namespace dc::transport
