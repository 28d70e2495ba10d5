// Shared macros for the header-only PTX helpers.
// Every helper in ptx/ is `DC_DEVICE` (device only) or `DC_HOST_DEVICE` with a plain C++ twin for host tests.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define DC_DEVICE __device__ __forceinline__
#define DC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DC_DEVICE inline
#define DC_HOST_DEVICE inline
#endif
