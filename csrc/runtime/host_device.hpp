// DC_HD marks a function of a header that host and device code both call (layouts, the transport's encoders and
// emulated NIC): forced inline in CUDA code, plain inline for the host compiler. The one definition for csrc/.
#pragma once

#if defined(__CUDACC__)
#define DC_HD __host__ __device__ __forceinline__
#else
#define DC_HD inline
#endif
