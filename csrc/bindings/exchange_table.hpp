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

}  // namespace dc::bindings
