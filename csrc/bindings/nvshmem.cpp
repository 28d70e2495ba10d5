// deepcomm._C.nvshmem: see csrc/transport/nvshmem_host.hpp. Blocking collectives release the GIL.
#include <pybind11/stl.h>

#include "../transport/nvshmem_host.hpp"
#include "registry.hpp"

namespace py = pybind11;

void dc::bindings::register_nvshmem(py::module_& m) {
#ifdef DEEPCOMM_WITH_NVSHMEM
  using namespace dc::nvshmem;
  using release = py::call_guard<py::gil_scoped_release>;
  auto s = m.def_submodule("nvshmem", "NVSHMEM host library, loaded at run time");
  auto triple = [](Version v) { return py::make_tuple(v.major, v.minor, v.patch); };
  s.def("load", &load, py::arg("candidates"));
  s.def("loaded", &loaded);
  s.def("loaded_path", &loaded_path);
  s.def("library_version", [triple] { return triple(library_version()); });
  s.def("header_version", [triple] { return triple(header_version()); });
  s.def("init_status", &init_status);
  s.def("unique_id_bytes", &unique_id_bytes);
  s.def("get_unique_id", [] { return py::bytes(get_unique_id()); });
  s.def("init_with_unique_id", [](py::bytes uid, int rank, int world_size, int device) {
    std::string id = uid;
    py::gil_scoped_release nogil;
    init_with_unique_id(id, rank, world_size, device);
  }, py::arg("unique_id"), py::arg("rank"), py::arg("world_size"), py::arg("device"));
  s.def("initialized", &initialized);
  s.def("my_pe", &my_pe);
  s.def("n_pes", &n_pes);
  s.def("symmetric_alloc", &symmetric_alloc, release());
  s.def("symmetric_free", &symmetric_free, release());
  s.def("peer_ptr", &peer_ptr);
  s.def("barrier_all", &barrier_all, release());
  s.def("finalize", &finalize, release());
  s.def("symbol_names", &symbol_names);
  s.attr("SIGNAL_SET") = signal_set();
  s.attr("SIGNAL_ADD") = signal_add();
  // Stream-ordered: they only enqueue work, so they keep the GIL.
  s.def("putmem_signal_on_stream", &putmem_signal_on_stream, py::arg("dest"), py::arg("source"), py::arg("bytes"),
        py::arg("sig_addr"), py::arg("signal"), py::arg("sig_op"), py::arg("pe"), py::arg("stream"));
  s.def("signal_op_on_stream", &signal_op_on_stream, py::arg("sig_addr"), py::arg("signal"), py::arg("sig_op"),
        py::arg("pe"), py::arg("stream"));
  s.def("quiet_on_stream", &quiet_on_stream, py::arg("stream"));
#else
  m.attr("NVSHMEM_MISSING") =
      "deepcomm._C was built without NVSHMEM support: the NVSHMEM headers were not found at build time "
      "(pip install nvidia-nvshmem-cu13, or set NVSHMEM_HOME, then rebuild deepcomm)";
#endif
}
