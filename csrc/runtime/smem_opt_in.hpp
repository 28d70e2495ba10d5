// Dynamic shared memory past the default: a launch whose shared memory in all (the kernel's static part counts
// too) passes 48 KB needs the kernel's opt-in first. One copy for every launcher that sizes shared memory at run
// time; the static part is asked once per kernel (a function-local static per instantiation), not per launch.
#pragma once
#include <cuda_runtime.h>

#include "cuda_check.hpp"

namespace dc {

template <auto kKernel>
int static_smem_bytes() {
  static const int bytes = [] {
    cudaFuncAttributes attr;
    DC_CUDA_CHECK(cudaFuncGetAttributes(&attr, kKernel));
    return int(attr.sharedSizeBytes);
  }();
  return bytes;
}

template <auto kKernel>
void opt_in_dynamic_smem(int bytes) {
  if (bytes + static_smem_bytes<kKernel>() > 48 * 1024)
    DC_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

// The most dynamic shared memory a block of kKernel may ask for on the current device (its opt-in maximum less the
// kernel's static part).
template <auto kKernel>
int dynamic_smem_room() {
  int device = 0, optin = 0;
  DC_CUDA_CHECK(cudaGetDevice(&device));
  DC_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return optin - static_smem_bytes<kKernel>();
}

}  // namespace dc
