// deepcomm._C.OwnedViews: framework tensors over parts of memory that one Python object owns (a dispatch's
// workspace tensor), each with a storage of its own, made through the framework's DLPack exchange table. A torch
// operator's outputs must not share a storage: views of one workspace made by torch would, these do not, and the
// owner lives until the last of them dies (no copy, no allocation). Also a host int32 tensor from a list of ints
// (an operator's per-expert counts) without torch's per-element conversion.
#include <Python.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "arena_views.hpp"
#include "exchange_table.hpp"
#include "registry.hpp"

namespace py = pybind11;

namespace dc::bindings {

namespace {

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// One view: the versioned tensor the table takes, its extents, and a strong reference to its owner (or none).
struct OwnedView {
  dlpack::ManagedTensorVersioned managed;  // first: the deleter gets its address
  int64_t shape[4];
  int64_t strides[4];
  PyObject* owner;
};

void delete_owned(dlpack::ManagedTensorVersioned* m) {
  auto* v = reinterpret_cast<OwnedView*>(m);
  // the framework may free a storage on a thread without the GIL; at exit the reference is left to the process
  if (v->owner != nullptr && Py_IsInitialized() && !interpreter_finalizing()) {
    const PyGILState_STATE g = PyGILState_Ensure();
    Py_DECREF(v->owner);
    PyGILState_Release(g);
  }
  delete v;
}

// A host int32 vector as a versioned tensor that owns it.
struct HostInts {
  dlpack::ManagedTensorVersioned managed;  // first
  int64_t shape[1];
  int64_t strides[1];
  std::vector<int32_t> values;
};

void delete_host_ints(dlpack::ManagedTensorVersioned* m) { delete reinterpret_cast<HostInts*>(m); }

struct OwnedViews {
  const dlpack::ExchangeApi* api = nullptr;
  py::object table_ref;  // keeps the table's capsule alive

  // The views `specs` (arena_views.hpp read_view_specs: byte offsets from `base`, contiguous) of the `nbytes` at
  // `base` that `owner` keeps alive (None: zero-size views only, or memory that outlives them).
  py::tuple views(py::handle owner, uintptr_t base, int64_t nbytes, int device_type, int device_id,
                  py::handle spec_seq) const {
    const std::vector<ArenaViewSpec> specs = read_view_specs(spec_seq, "OwnedViews.views");
    for (const ArenaViewSpec& s : specs) {  // all checked before any view exists
      if (checked_view_bytes(s, nbytes, "OwnedViews.views") > 0 && owner.is_none())
        throw std::invalid_argument("OwnedViews.views: a view with elements needs an owner");
    }
    py::tuple out(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) {
      const ArenaViewSpec& s = specs[i];
      auto* v = new OwnedView{};
      describe_view(v->managed.dl_tensor, s, reinterpret_cast<void*>(base + uintptr_t(s.offset)),
                    dlpack::Device{device_type, device_id}, v->shape, v->strides);
      v->managed.version = dlpack::Version{dlpack::kExchangeApiMajor, 0};
      v->managed.deleter = delete_owned;
      v->owner = owner.is_none() ? nullptr : owner.ptr();
      Py_XINCREF(v->owner);
      out[i] = framework_tensor(api, &v->managed);
    }
    return out;
  }

  // `values` (a list or tuple of ints) as a 1-D int32 tensor in host memory of its own
  py::object int32_host(py::handle values) const {
    PyObject* seq = values.ptr();
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) throw py::type_error("OwnedViews.int32_host: a list of ints");
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    auto* h = new HostInts{};
    h->values.resize(size_t(n));
    PyObject** items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; ++i) {
      const long v = PyLong_AsLong(items[i]);
      if ((v == -1 && PyErr_Occurred()) || v < INT32_MIN || v > INT32_MAX) {
        PyErr_Clear();
        delete h;
        throw py::type_error("OwnedViews.int32_host: item " + std::to_string(i) + " is not an int32");
      }
      h->values[size_t(i)] = int32_t(v);
    }
    h->shape[0] = n;
    h->strides[0] = 1;
    dlpack::Tensor& t = h->managed.dl_tensor;
    t.data = h->values.data();
    t.device = dlpack::Device{dlpack::kCPU, 0};
    t.ndim = 1;
    t.dtype = dlpack::DataType{dlpack::kInt, 32, 1};
    t.shape = h->shape;
    t.strides = h->strides;
    t.byte_offset = 0;
    h->managed.version = dlpack::Version{dlpack::kExchangeApiMajor, 0};
    h->managed.deleter = delete_host_ints;
    return framework_tensor(api, &h->managed);
  }
};

}  // namespace

void register_owned_views(py::module_& m) {
  py::class_<OwnedViews>(m, "OwnedViews")
      // table: the capsule of the framework's DLPack exchange table; ValueError where it cannot make tensors
      .def(py::init([](py::object table) {
        const dlpack::ExchangeApi* api = exchange_table(table);
        if (api == nullptr || api->managed_tensor_to_py_object_no_sync == nullptr)
          throw py::value_error("OwnedViews: the exchange table is missing or of another major version");
        auto* o = new OwnedViews;
        o->api = api;
        o->table_ref = std::move(table);
        return o;
      }), py::arg("table"))
      .def("views", &OwnedViews::views, py::arg("owner"), py::arg("base"), py::arg("nbytes"),
           py::arg("device_type"), py::arg("device_id"), py::arg("specs"))
      .def("int32_host", &OwnedViews::int32_host, py::arg("values"));
}

}  // namespace dc::bindings
