// Setting up a device queue pair (device_qp_layout.hpp) before its first use: the NIC transport does it once per
// queue pair (deepcomm/internode/nic_transport.py), the device-QP tests before each check.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "device_qp_layout.hpp"

namespace dc {

// Zero the queue pair at `base`, mark every CQE invalid, and start all WQEBB indices (poster counters and the
// doorbell record) at `start`, so tests can begin just before the 16-bit index wrap.
void launch_device_qp_init(uint8_t* base, const transport::DeviceQpLayout& layout, uint32_t start,
                           cudaStream_t stream);

}  // namespace dc
