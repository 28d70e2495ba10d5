// Dynamic shared memory past the default: a launch whose shared memory in all (the kernel's static part counts
// too) passes 48 KB needs the kernel's opt-in first. One copy for every launcher that sizes shared memory at run
// time; the static part is asked once per kernel (a function-local static per instantiation), not per launch.
#pragma once
#include <cuda_runtime.h>

#include "cuda_check.hpp"

namespace dc {

template <auto kKernel>
void opt_in_dynamic_smem(int bytes) {
  static const int static_bytes = [] {
    cudaFuncAttributes attr;
    DC_CUDA_CHECK(cudaFuncGetAttributes(&attr, kKernel));
    return int(attr.sharedSizeBytes);
  }();
  if (bytes + static_bytes > 48 * 1024)
    DC_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

}  // namespace dc
