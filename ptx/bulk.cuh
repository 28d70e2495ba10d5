// Bulk copies (the Tensor Memory Accelerator's 1-D form, sm_90) between global and shared memory, and the
// shared-memory barriers their loads complete on. One thread issues a copy of many bytes; the copy runs in the
// async proxy, so the SM keeps many rows in flight without holding them in registers.
//   load:  global -> shared, completes on an mbarrier that expects the copy's bytes (mbar_expect_bytes first);
//   store: shared -> global (also a peer's memory through its mapped address), completes in bulk groups: after
//          bulk_commit, bulk_wait_read<N> lets the shared memory be reused once all but the newest N groups have
//          read it, bulk_wait_all waits until every group's writes are performed.
// Addresses and sizes are multiples of 16 bytes.
#pragma once
#include "common.cuh"

namespace dc::ptx {
#if defined(__CUDACC__)

DC_DEVICE uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// ---- shared-memory barriers ----
DC_DEVICE void mbar_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}
// After mbar_init, before a bulk copy may complete on the barrier.
DC_DEVICE void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
DC_DEVICE void mbar_inval(uint64_t* bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// This thread's arrival, and the bytes the barrier's current phase waits for.
DC_DEVICE void mbar_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
// True once the phase of parity `parity` has completed (the hardware may suspend the thread a while first).
DC_DEVICE bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// ---- bulk copies ----
DC_DEVICE void bulk_load(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(smem_dst)),
               "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
DC_DEVICE void bulk_store(void* gmem_dst, const void* smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem_dst), "r"(smem_addr(smem_src)),
               "r"(bytes)
               : "memory");
}
DC_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
DC_DEVICE void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
// Every committed group's writes performed, then ordered before this thread's later generic-proxy accesses
// (a release that publishes the rows to peers).
DC_DEVICE void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

#endif
}  // namespace dc::ptx
