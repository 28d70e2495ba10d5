// deepcomm._C: the CUDA core's one Python module. Raw device pointers (int), sizes and cudaStream_t (int); torch
// tensors reach it only where torch describes them through the DLPack exchange table (DispatchArgReader), and it
// never links libtorch or libcuda. One file per subsystem registers its part (registry.hpp); the self-tests are in the test-only module deepcomm._selftest (csrc/selftest/).
#include <pybind11/pybind11.h>

#include "registry.hpp"

PYBIND11_MODULE(_C, m) {
  using namespace dc::bindings;
  register_transport(m);
  register_nvshmem(m);
  m.doc() = "deepcomm CUDA core (raw pointers and streams; no libtorch)";
  register_constants(m);
  register_runtime(m);
  register_layouts(m);
  register_nvlink(m);
  register_low_latency(m);
  register_arena(m);
  register_dispatch_args(m);
  register_owned_views(m);
}
