// Device memory shared between the processes of one node through CUDA IPC handles. The handle bytes travel
// through torch.distributed in Python; these functions only allocate, export, open and close.
#pragma once
#include <cstdint>
#include <string>

namespace dc {

struct DeviceAlloc {
  uintptr_t ptr;
  std::string ipc_handle;  // cudaIpcMemHandle_t bytes
};

DeviceAlloc ipc_alloc(int64_t bytes);               // cudaMalloc + zero-fill + export handle
uintptr_t ipc_open(const std::string& handle);      // map a peer's allocation into this process
void ipc_close(uintptr_t ptr);                      // unmap a peer allocation
void device_free(uintptr_t ptr);

// Pinned host memory that the device can write (error records, small results).
uintptr_t host_mapped_alloc(int64_t bytes, uintptr_t* device_ptr);
void host_mapped_free(uintptr_t host_ptr);

}  // namespace dc
