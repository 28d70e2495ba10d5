// The kernel behind launch_device_qp_init (device_qp_init.hpp).
#include "device_qp_init.hpp"

#include "../runtime/cuda_check.hpp"
#include "device_qp.cuh"

namespace dc {

using namespace transport;

namespace {

constexpr int kInitThreads = 256;

__global__ void device_qp_init_kernel(uint8_t* base, DeviceQpLayout layout, uint32_t start) {
  auto* words = reinterpret_cast<uint64_t*>(base);
  for (uint64_t i = threadIdx.x; i < layout.total / 8; i += blockDim.x) words[i] = 0;
  __syncthreads();
  const DeviceQp qp = DeviceQp::at(base, layout, 0);
  for (uint32_t i = threadIdx.x; i < qp.cq.size(); i += blockDim.x) qp.cq.cqe(i)[63] = uint8_t(kCqeInvalid << 4);
  if (threadIdx.x == 0) qp_init_counters(qp, start);
}

}  // namespace

void launch_device_qp_init(uint8_t* base, const DeviceQpLayout& layout, uint32_t start, cudaStream_t stream) {
  device_qp_init_kernel<<<1, kInitThreads, 0, stream>>>(base, layout, start);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
