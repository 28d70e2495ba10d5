// Host-side CUDA error checking: a failed call throws std::runtime_error with the call, file and line,
// which pybind11 turns into a Python RuntimeError. Nothing here exits the process.
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#define DC_CUDA_CHECK(call)                                                                             \
  do {                                                                                                  \
    cudaError_t dc_err_ = (call);                                                                       \
    if (dc_err_ != cudaSuccess) {                                                                       \
      throw std::runtime_error(std::string("deepcomm: ") + #call + " failed: " +                       \
                               cudaGetErrorString(dc_err_) + " (" + __FILE__ + ":" +                   \
                               std::to_string(__LINE__) + ")");                                         \
    }                                                                                                   \
  } while (0)

#define DC_HOST_ASSERT(cond, msg)                                                                       \
  do {                                                                                                  \
    if (!(cond)) {                                                                                      \
      throw std::invalid_argument(std::string("deepcomm: ") + (msg) + " (" + __FILE__ + ":" +          \
                                  std::to_string(__LINE__) + ")");                                      \
    }                                                                                                   \
  } while (0)
