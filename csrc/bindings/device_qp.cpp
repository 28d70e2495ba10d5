// deepcomm._C.transport, device part: the layout of a device queue pair and its initialisation (the checks of
// device posting and of the device emulated NIC are in deepcomm._selftest). Pointers are ints; streams are ints.
#include <pybind11/stl.h>

#include <stdexcept>

#include "../runtime/cuda_check.hpp"
#include "../transport/device_qp_init.hpp"
#include "../transport/device_qp_checked.hpp"
#include "registry.hpp"

namespace py = pybind11;
using namespace dc;
using namespace dc::transport;

void dc::bindings::register_device_qp(py::module_& m) {
  m.def("device_qp_layout", [](uint32_t log_wqebbs, uint32_t log_cqes) {
    const DeviceQpLayout l = checked_layout(log_wqebbs, log_cqes);
    py::dict d;
    d["ring"] = l.ring; d["cqes"] = l.cqes; d["dbrec"] = l.dbrec; d["doorbell"] = l.doorbell;
    d["cq_dbrec"] = l.cq_dbrec; d["poster"] = l.poster; d["nic"] = l.nic; d["total"] = l.total;
    d["poster_fields"] = py::make_tuple("reserved", "published", "retired", "cq_ci", "lock", "cqes_seen",
                                        "error_cqes", "first_syndrome");
    d["nic_fields"] = py::make_tuple("consumed", "wqes", "cqes", "error", "stopped");
    return d;
  }, py::arg("log_wqebbs"), py::arg("log_cqes"),
     "Byte offsets of a device queue pair's parts (64-byte aligned) and the u32 fields of its poster/NIC records.");
  m.def("device_qp_init", [](uintptr_t base, uint32_t log_wqebbs, uint32_t log_cqes, uint32_t start, uintptr_t stream) {
    launch_device_qp_init(reinterpret_cast<uint8_t*>(base), checked_layout(log_wqebbs, log_cqes), start,
                          reinterpret_cast<cudaStream_t>(stream));
  }, py::arg("base"), py::arg("log_wqebbs"), py::arg("log_cqes"), py::arg("start"), py::arg("stream"));
}
