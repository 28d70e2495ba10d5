// deepcomm._C.ArenaCore: the dispatch-output arena (runtime/arena_core.hpp). Its views leave as DLPack capsules
// handed to the consumer given at construction (a DLPack importer such as torch's), or through the framework's
// DLPack exchange table where one was given, so one crossing returns every typed tensor of a call; the module
// itself knows no framework.
#include <Python.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <vector>

#include "arena_views.hpp"
#include "exchange_table.hpp"
#include "registry.hpp"

namespace py = pybind11;

namespace dc::bindings {

namespace {

void capsule_destructor(PyObject* capsule) {  // a capsule no consumer took: its view dies with it
  if (PyCapsule_IsValid(capsule, dlpack::kCapsuleName)) {
    auto* m = static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule, dlpack::kCapsuleName));
    m->deleter(m);
  }
}

// A view handed to a framework through its exchange table: the versioned form the table takes, around the arena's
// view (whose deleter gives its share of the block back).
struct VersionedView {
  dlpack::ManagedTensorVersioned managed;  // first: the table's deleter gets its address
  dlpack::ManagedTensor* view;
};

void delete_versioned(dlpack::ManagedTensorVersioned* m) {
  auto* v = reinterpret_cast<VersionedView*>(m);
  v->view->deleter(v->view);
  delete v;
}

// made[i] as the framework's tensor through its exchange table; the views from i on are the caller's until then
py::object exchange_view(const dlpack::ExchangeApi* api, dlpack::ManagedTensor* view) {
  auto* v = new VersionedView{{{dlpack::kExchangeApiMajor, 0}, nullptr, delete_versioned, 0, view->dl_tensor}, view};
  return framework_tensor(api, &v->managed);
}

int64_t as_int(PyObject* o, const char* who, const char* what) {
  const long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::type_error(std::string(who) + ": " + what + " must be an int");
  }
  return v;
}

}  // namespace

// specs: a sequence of (byte offset, shape tuple, DLPack type code, bits), read with the C API (this is per call)
std::vector<ArenaViewSpec> read_view_specs(py::handle specs, const char* who) {
  py::sequence seq = py::reinterpret_borrow<py::sequence>(specs);
  std::vector<ArenaViewSpec> out(seq.size());
  for (size_t i = 0; i < out.size(); ++i) {
    py::handle item = seq[i];
    if (!PyTuple_Check(item.ptr()) || PyTuple_GET_SIZE(item.ptr()) != 4)
      throw py::type_error(std::string(who) + ": a spec is (offset, shape, type code, bits)");
    PyObject* t = item.ptr();
    ArenaViewSpec& s = out[i];
    s.offset = as_int(PyTuple_GET_ITEM(t, 0), who, "offset");
    PyObject* shape = PyTuple_GET_ITEM(t, 1);
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) < 1 || PyTuple_GET_SIZE(shape) > 4)
      throw py::type_error(std::string(who) + ": shape must be a tuple of 1 to 4 ints");
    s.ndim = int(PyTuple_GET_SIZE(shape));
    for (int d = 0; d < s.ndim; ++d) s.shape[d] = as_int(PyTuple_GET_ITEM(shape, d), who, "shape");
    s.dtype = dlpack::DataType{uint8_t(as_int(PyTuple_GET_ITEM(t, 2), who, "type code")),
                               uint8_t(as_int(PyTuple_GET_ITEM(t, 3), who, "bits")), 1};
  }
  return out;
}

py::tuple consume_views(BoundArena& a, int64_t offset, int64_t size, bool owned,
                        const std::vector<ArenaViewSpec>& specs) {
  std::vector<dlpack::ManagedTensor*> made = a.core.views(offset, size, owned, specs);
  if (a.exchange != nullptr) {
    py::tuple out(made.size());
    for (size_t i = 0; i < made.size(); ++i) {
      try {
        out[i] = exchange_view(a.exchange, made[i]);
      } catch (...) {  // the views not yet handed over die here, the others with their tensors
        for (size_t j = i + 1; j < made.size(); ++j) made[j]->deleter(made[j]);
        throw;
      }
    }
    return out;
  }
  std::vector<py::object> capsules;  // each owns its view until the consumer takes it
  capsules.reserve(made.size());
  for (size_t i = 0; i < made.size(); ++i) {
    PyObject* c = PyCapsule_New(made[i], dlpack::kCapsuleName, capsule_destructor);
    if (c == nullptr) {  // the views not yet in a capsule die here, those in one with their capsule
      for (size_t j = i; j < made.size(); ++j) made[j]->deleter(made[j]);
      throw py::error_already_set();
    }
    capsules.push_back(py::reinterpret_steal<py::object>(c));
  }
  py::tuple out(capsules.size());
  for (size_t i = 0; i < capsules.size(); ++i) out[i] = a.consumer(capsules[i]);
  return out;
}

py::tuple dispatch_outputs(BoundArena& a, int64_t offset, int64_t size, bool owned, const DispatchOutputs& o,
                           int64_t n) {
  const DispatchViewSpecs v = dispatch_view_specs(o, n);
  py::tuple made = consume_views(a, offset, size, owned, v.specs);
  py::tuple out(4);
  for (int i = 0; i < 4; ++i) {
    py::object view = py::none();
    if (v.slot[i] >= 0) view = made[size_t(v.slot[i])];
    out[i] = view;
  }
  return out;
}

namespace {

// What into_block's Python launch reports (the fields of NvlDispatchResult it reads), and what it returned.
struct ReportedLaunch {
  int status = 0;
  int num_recv = 0;
  int64_t out[6] = {0, 0, 0, 0, 0, 0};  // out[5]: the bytes the rows use
  py::object returned;
};

}  // namespace

void register_arena(py::module_& m) {
  m.attr("DLPACK_CPU") = int(dlpack::kCPU);
  m.attr("DLPACK_CUDA") = int(dlpack::kCUDA);
  py::class_<BoundArena>(m, "ArenaCore")
      // exchange: the capsule of the framework's DLPack exchange table (its views are made through it), or None;
      // without a usable table each view leaves as a capsule handed to `consumer`
      .def(py::init([](uintptr_t base, int64_t nbytes, int64_t align, int device_type, int device_id,
                       py::object consumer, py::object exchange) {
             auto* a = new BoundArena{ArenaCore(base, nbytes, align, dlpack::Device{device_type, device_id}),
                                      std::move(consumer)};
             const dlpack::ExchangeApi* table = exchange_table(exchange);
             if (table != nullptr && table->managed_tensor_to_py_object_no_sync != nullptr) {
               a->exchange = table;
               a->exchange_ref = std::move(exchange);
             }
             return a;
           }),
           py::arg("base"), py::arg("nbytes"), py::arg("align"), py::arg("device_type"), py::arg("device_id"),
           py::arg("consumer"), py::arg("exchange") = py::none())
      .def("reserve", [](BoundArena& a, int64_t nbytes) -> py::object {
        auto r = a.core.reserve(nbytes);
        if (!r) return py::none();
        return py::make_tuple(r->first, r->second);
      })
      .def("trim", [](BoundArena& a, int64_t offset, int64_t size, int64_t used) {
        auto r = a.core.trim(offset, size, used);
        return py::make_tuple(r.first, r.second);
      })
      .def("release", [](BoundArena& a, int64_t offset, int64_t size) { a.core.release(offset, size); })
      .def("free_bytes", [](BoundArena& a) { return a.core.free_bytes(); })
      .def_property_readonly("releases", [](const BoundArena& a) { return a.core.releases(); })
      .def("views", [](BoundArena& a, int64_t offset, int64_t size, bool owned, py::handle specs) {
        return consume_views(a, offset, size, owned, read_view_specs(specs, "ArenaCore.views"));
      }, py::arg("offset"), py::arg("size"), py::arg("owned"), py::arg("specs"))
      // a dispatch's (x, scales, topk_idx, topk_weights) over a range, as dispatch_into makes them (the bounce area)
      .def("dispatch_views", [](BoundArena& a, int64_t offset, int64_t size, bool owned, int64_t n, int x_type,
                                int64_t x_row_bytes, int scale_type, int64_t scale_row_bytes, int64_t topk,
                                bool with_idx, bool with_weights) {
        return dispatch_outputs(a, offset, size, owned,
                                DispatchOutputs{x_type, x_row_bytes, scale_type, scale_row_bytes, topk, with_idx,
                                                with_weights}, n);
      })
      // NvlContext.dispatch_into's arena side (arena_views.hpp into_block) around a Python `launch(offset)` that
      // returns (status, rows, bytes the rows use, anything): None when no block of `need` bytes is free, else
      // (what launch returned, the views or None). The CPU stand-ins of the kernels go through it.
      .def("into_block", [](BoundArena& a, int64_t need, bool waited, int x_type, int64_t x_row_bytes,
                            int scale_type, int64_t scale_row_bytes, int64_t topk, bool with_idx, bool with_weights,
                            py::function launch) -> py::object {
        const DispatchOutputs o{x_type, x_row_bytes, scale_type, scale_row_bytes, topk, with_idx, with_weights};
        auto got = into_block(a, need, waited, o, [&](int64_t offset) {
          py::tuple t = launch(offset);
          ReportedLaunch r;
          r.status = t[0].cast<int>();
          r.num_recv = t[1].cast<int>();
          r.out[5] = t[2].cast<int64_t>();
          r.returned = t[3];
          return r;
        });
        if (!got) return py::none();
        return py::make_tuple(got->result.returned, got->views);
      });
}

}  // namespace dc::bindings
