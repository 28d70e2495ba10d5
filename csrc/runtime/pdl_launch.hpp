// One kernel launch, optionally with programmatic dependent launch (PDL, sm_90): the kernel may then be scheduled
// while the kernel before it in the stream is still running, so its blocks are resident and start the moment that
// kernel completes instead of paying a launch after it. Kernels launched so must call ptx::grid_dependency_wait()
// before they touch anything an earlier kernel writes (the low-latency kernels do it first thing: ll_gate in
// csrc/kernels/ll_common.cuh), and may call ptx::launch_dependents() to let the next one in. Works under CUDA-graph
// capture (programmatic edges).
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "cuda_check.hpp"

namespace dc {

template <typename... KernelArgs, typename... Args>
void launch_kernel(void (*kernel)(KernelArgs...), int blocks, int threads, int smem, cudaStream_t stream, bool pdl,
                   Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = pdl ? &attr : nullptr;
  cfg.numAttrs = pdl ? 1 : 0;
  DC_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace dc
