// The first launch of every collective call: advance this rank's device-side sequence number. Kernels of
// the call read it at entry; being a kernel (not a host value) it advances on every CUDA-graph replay too.
#include "../runtime/cuda_check.hpp"
#include "api.hpp"

namespace dc {

__global__ void bump_seq_kernel(uint64_t* counter) { *counter += 1; }

void launch_bump_seq(uint64_t* counter, cudaStream_t stream) {
  bump_seq_kernel<<<1, 1, 0, stream>>>(counter);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
