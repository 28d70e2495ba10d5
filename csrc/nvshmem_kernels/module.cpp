// deepcomm._nvshmem_kernels: the hierarchical internode kernels (csrc/kernels/hier_{dispatch,combine}.cu, compiled a
// second time with DEEPCOMM_NVSHMEM_DEVICE) whose poster issues NVSHMEM device puts (hier_nvshmem_poster.cuh).
// Optional: built only where NVSHMEM's headers and device library are found (setup.py), with relocatable device
// code linked against libnvshmem_device.a; it needs libnvshmem_host.so.3 at run time, the same library
// deepcomm._C opens with dlopen (one instance per process: the loader matches it by soname). It links neither
// libtorch nor libcuda. Raw pointers and streams as ints, like deepcomm._C; the launches take the typed arguments
// deepcomm._C.transport binds (HierDispatchLaunch, HierCombineLaunch: csrc/bindings/hier_launch.hpp), so
// deepcomm._C must be imported first (the transports are its).
#include <host/nvshmem_api.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "../bindings/hier_launch.hpp"
#include "../transport/key_table.hpp"

namespace py = pybind11;
using namespace dc;
using dc::bindings::HierCombineLaunch;
using dc::bindings::HierDispatchLaunch;

namespace {

bool g_device_state = false;

// Register this module's nvshmemi_device_state_d with the host library, which fills it (peer heap bases,
// transports) now and on every later change. NVSHMEM must already be initialized by deepcomm._C.nvshmem (the
// Buffer's session): the device archive's nvshmemi_init_thread then only adds this module (bootstrap flags 0,
// no collective), where a first call would start NVSHMEM's collective initialization.
void init_device_state() {
  if (g_device_state) return;
  const int status = nvshmemx_init_status();
  if (status < NVSHMEM_STATUS_IS_INITIALIZED)
    throw std::runtime_error("deepcomm._nvshmem_kernels: NVSHMEM is not initialized in this process (status " +
                             std::to_string(status) + "); allocate the transport's symmetric block first");
  int provided = 0;
  const nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                      NVSHMEM_VENDOR_PATCH_VERSION};
  if (nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, 0, nullptr, version) != 0)
    throw std::runtime_error("deepcomm._nvshmem_kernels: registering the device state with NVSHMEM failed");
  g_device_state = true;
}

void require_device_state(const char* what) {
  if (!g_device_state)
    throw std::runtime_error(std::string("deepcomm._nvshmem_kernels.") + what + ": call init_device_state() first");
}

}  // namespace

PYBIND11_MODULE(_nvshmem_kernels, m) {
  m.doc() = "deepcomm's hierarchical internode kernels over NVSHMEM device puts (raw pointers and streams)";
  m.attr("NVSHMEM_VERSION") = std::to_string(NVSHMEM_VENDOR_MAJOR_VERSION) + "." +
                              std::to_string(NVSHMEM_VENDOR_MINOR_VERSION) + "." +
                              std::to_string(NVSHMEM_VENDOR_PATCH_VERSION);
  m.attr("NVSHMEM_CHUNKS") = kNvshmemChunks;
  m.def("init_device_state", &init_device_state,
        "Register this module's NVSHMEM device state (NVSHMEM must be initialized); idempotent.");
  m.def("device_state_ready", [] { return g_device_state; });
  m.def("hier_dispatch", [](const HierDispatchLaunch& l, uintptr_t stream) {
    require_device_state("hier_dispatch");
    launch_hier_dispatch(l.args(), transport::KeyTable{}, l.common.wait_ctx(), reinterpret_cast<cudaStream_t>(stream));
  }, py::arg("launch"), py::arg("stream"), "Launch one hierarchical dispatch whose RDMA hop is NVSHMEM device puts.");
  m.def("hier_combine", [](const HierCombineLaunch& l, uintptr_t stream) {
    require_device_state("hier_combine");
    launch_hier_combine(l.args(), transport::KeyTable{}, l.common.wait_ctx(), reinterpret_cast<cudaStream_t>(stream));
  }, py::arg("launch"), py::arg("stream"), "Launch one hierarchical combine whose RDMA hop is NVSHMEM device puts.");
}
