// Memory fences by scope, and the async-proxy fences: for shared memory read by bulk copies, and for global memory
// written through the generic proxy (by a peer, acquired) that a bulk copy then reads.
#pragma once
#include "common.cuh"

namespace dc::ptx {
#if defined(__CUDACC__)
DC_DEVICE void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
DC_DEVICE void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
DC_DEVICE void fence_sc_sys() { asm volatile("fence.sc.sys;" ::: "memory"); }
DC_DEVICE void fence_proxy_async_shared_cta() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
DC_DEVICE void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
#endif
}  // namespace dc::ptx
