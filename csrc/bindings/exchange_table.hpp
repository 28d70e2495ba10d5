// torch's DLPack exchange table (runtime/dlpack_abi.hpp ExchangeApi) from the capsule Python gives a binding
// (torch.Tensor.__dlpack_c_exchange_api__), for every binding that uses it: the arena's views, the argument reader.
#pragma once
#include <Python.h>
#include <pybind11/pybind11.h>

#include "../runtime/dlpack_abi.hpp"

namespace dc::bindings {

// The table, or null where `capsule` is None or does not hold a table of the major version declared here (the
// caller then does without it).
inline const dlpack::ExchangeApi* exchange_table(pybind11::handle capsule) {
  if (capsule.is_none()) return nullptr;
  const auto* api =
      static_cast<const dlpack::ExchangeApi*>(PyCapsule_GetPointer(capsule.ptr(), dlpack::kExchangeApiCapsuleName));
  if (api == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  return api->header.version.major == dlpack::kExchangeApiMajor ? api : nullptr;
}

// `managed` as the framework's tensor, made by the table; the table owns `managed` from here whatever it returns.
inline pybind11::object framework_tensor(const dlpack::ExchangeApi* api, dlpack::ManagedTensorVersioned* managed) {
  void* out = nullptr;
  if (api->managed_tensor_to_py_object_no_sync(managed, &out) != 0) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::object>(static_cast<PyObject*>(out));
}

}  // namespace dc::bindings
