// Memory fences by scope, and the async-proxy fence for shared memory read by bulk copies.
#pragma once
#include "common.cuh"

namespace dc::ptx {
#if defined(__CUDACC__)
DC_DEVICE void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
DC_DEVICE void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
DC_DEVICE void fence_sc_sys() { asm volatile("fence.sc.sys;" ::: "memory"); }
DC_DEVICE void fence_proxy_async_shared_cta() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#endif
}  // namespace dc::ptx
