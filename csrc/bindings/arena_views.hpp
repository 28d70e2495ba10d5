// The Python-facing arena (deepcomm._C.ArenaCore, arena.cpp) as other bindings see it: a call that launches into an
// arena block makes its outputs' views in the same crossing (nvlink.cpp's dispatch_into).
#pragma once
#include <pybind11/pybind11.h>

#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "../runtime/arena_core.hpp"
#include "../runtime/dispatch_views.hpp"

namespace dc::bindings {

struct BoundArena {
  ArenaCore core;
  pybind11::object consumer;  // takes a DLPack capsule, returns the framework's tensor (torch's importer)
  // the framework's DLPack exchange table (runtime/dlpack_abi.hpp), where it has one: its views are then made by
  // the table's managed_tensor_to_py_object_no_sync, without a capsule or a call through Python; else null
  const dlpack::ExchangeApi* exchange = nullptr;
  pybind11::object exchange_ref;  // keeps the table's capsule alive
};

// View specs from Python: a sequence of (byte offset, shape tuple of 1 to 4 ints, DLPack type code, bits); `who`
// names the caller in a TypeError.
std::vector<ArenaViewSpec> read_view_specs(pybind11::handle specs, const char* who);

// The views `specs` of the reserved range (offset, size), each handed to the arena's consumer.
pybind11::tuple consume_views(BoundArena& a, int64_t offset, int64_t size, bool owned,
                              const std::vector<ArenaViewSpec>& specs);

// A dispatch's four outputs (x, scales, topk_idx, topk_weights; None where not returned) for n rows of the block.
pybind11::tuple dispatch_outputs(BoundArena& a, int64_t offset, int64_t size, bool owned, const DispatchOutputs& o,
                                 int64_t n);

// A call's result and the views of its rows (None where the block was given back or kept for a broken buffer).
template <class Result>
struct IntoBlock {
  Result result;
  pybind11::object views;
};

// The arena side of a dispatch into an arena block: reserve `need` bytes (nullopt: none free, nothing launched),
// run `launch(block offset in the arena)`, then by its result's status keep the block (0), keep it unused for a
// buffer the call broke (1: a kernel may still write it), or give it back (else: the kernels returned at once; or
// the launch threw). A kept block of a waited call is trimmed to the bytes its rows use (result.out[5]); the views
// are made for result.num_recv rows. Result: NvlDispatchResult's status, num_recv and out fields.
template <class Launch, class Result = std::invoke_result_t<Launch, int64_t>>
std::optional<IntoBlock<Result>> into_block(BoundArena& a, int64_t need, bool waited, const DispatchOutputs& o,
                                            Launch&& launch) {
  const auto got = a.core.reserve(need);
  if (!got) return std::nullopt;
  Result r;
  try {
    r = launch(got->first);
  } catch (...) {
    a.core.release(got->first, got->second);  // nothing of this call reads the block
    throw;
  }
  if (r.status != 0) {
    if (r.status != 1) a.core.release(got->first, got->second);
    return IntoBlock<Result>{std::move(r), pybind11::none()};
  }
  const ArenaCore::Range kept = waited ? a.core.trim(got->first, got->second, r.out[5]) : *got;
  pybind11::object views = dispatch_outputs(a, kept.first, kept.second, true, o, r.num_recv);
  return IntoBlock<Result>{std::move(r), std::move(views)};
}

}  // namespace dc::bindings
