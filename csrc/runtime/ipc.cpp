#include "ipc.hpp"

#include <cstring>

#include "cuda_check.hpp"

namespace dc {

DeviceAlloc ipc_alloc(int64_t bytes) {
  DC_HOST_ASSERT(bytes > 0, "ipc_alloc: bytes must be positive");
  void* p = nullptr;
  DC_CUDA_CHECK(cudaMalloc(&p, size_t(bytes)));
  DC_CUDA_CHECK(cudaMemset(p, 0, size_t(bytes)));
  DC_CUDA_CHECK(cudaDeviceSynchronize());
  cudaIpcMemHandle_t h;
  DC_CUDA_CHECK(cudaIpcGetMemHandle(&h, p));
  return {reinterpret_cast<uintptr_t>(p), std::string(reinterpret_cast<const char*>(&h), sizeof(h))};
}

uintptr_t ipc_open(const std::string& handle) {
  DC_HOST_ASSERT(handle.size() == sizeof(cudaIpcMemHandle_t), "ipc_open: handle has the wrong size");
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  DC_CUDA_CHECK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
  return reinterpret_cast<uintptr_t>(p);
}

void ipc_close(uintptr_t ptr) { DC_CUDA_CHECK(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr))); }

void device_free(uintptr_t ptr) { DC_CUDA_CHECK(cudaFree(reinterpret_cast<void*>(ptr))); }

uintptr_t host_mapped_alloc(int64_t bytes, uintptr_t* device_ptr) {
  void* h = nullptr;
  DC_CUDA_CHECK(cudaHostAlloc(&h, size_t(bytes), cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(h, 0, size_t(bytes));
  void* d = nullptr;
  DC_CUDA_CHECK(cudaHostGetDevicePointer(&d, h, 0));
  *device_ptr = reinterpret_cast<uintptr_t>(d);
  return reinterpret_cast<uintptr_t>(h);
}

void host_mapped_free(uintptr_t host_ptr) { DC_CUDA_CHECK(cudaFreeHost(reinterpret_cast<void*>(host_ptr))); }

}  // namespace dc
