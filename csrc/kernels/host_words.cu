// Device words to mapped host memory, tagged; the host's bounded wait for the tag (contract in host_words.hpp).
#include <cuda_runtime.h>

#include <chrono>
#include <thread>

#include "../../ptx/ptx.cuh"
#include "../runtime/cuda_check.hpp"
#include "host_words.hpp"

namespace dc {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) words_to_host_kernel(const int32_t* src, int64_t n, int32_t* dst,
                                                                 uint64_t* tag_word, uint64_t tag) {
  // src was written by earlier kernels of the stream (finished before this one started): plain loads.
  for (int64_t i = threadIdx.x; i < n; i += kThreads) dst[i] = src[i];
  __syncthreads();
  if (threadIdx.x == 0) {
    ptx::fence_acq_rel_sys();  // every thread's words (ordered by the barrier) before the tag, at system scope
    ptx::st_release_sys_u64(tag_word, tag);
  }
}

}  // namespace

void launch_words_to_host(const int32_t* src, int64_t n, uint8_t* mapped_dev, uint64_t tag, cudaStream_t stream) {
  DC_HOST_ASSERT(n >= 0 && (n == 0 || src != nullptr) && mapped_dev != nullptr,
                 "words_to_host: needs n >= 0 words, a source and the mapped block");
  DC_HOST_ASSERT(reinterpret_cast<uintptr_t>(mapped_dev) % 8 == 0 && reinterpret_cast<uintptr_t>(src) % 4 == 0,
                 "words_to_host: the mapped block must be 8-byte aligned, the source 4-byte aligned");
  words_to_host_kernel<<<1, kThreads, 0, stream>>>(src, n, reinterpret_cast<int32_t*>(mapped_dev + kHostWordsOffset),
                                                   reinterpret_cast<uint64_t*>(mapped_dev), tag);
  DC_CUDA_CHECK(cudaGetLastError());
}

HostTagWait wait_host_tag(const uint8_t* mapped_host, uint64_t tag, double timeout_s,
                          const std::vector<const ErrorRecord*>& errors) {
  const auto* word = reinterpret_cast<const uint64_t*>(mapped_host);
  const auto t0 = std::chrono::steady_clock::now();
  const auto limit = std::chrono::duration<double>(timeout_s);
  for (uint32_t spin = 0;; ++spin) {
    if (__atomic_load_n(word, __ATOMIC_ACQUIRE) == tag) return kHostTagArrived;
    if ((spin & 255u) == 255u) {
      for (const ErrorRecord* e : errors)
        if (e != nullptr && __atomic_load_n(&e->flag, __ATOMIC_ACQUIRE) != 0) return kHostTagDeviceError;
      if (std::chrono::steady_clock::now() - t0 > limit) return kHostTagTimeout;
      if (spin > 4096) std::this_thread::yield();  // a long wait (a slow peer): leave the core to others
    }
  }
}

}  // namespace dc
