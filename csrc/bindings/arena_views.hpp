// The Python-facing arena (deepcomm._C.ArenaCore, arena.cpp) as other bindings see it: a call that launches into an
// arena block makes its outputs' views in the same crossing (nvlink.cpp's dispatch_into).
#pragma once
#include <pybind11/pybind11.h>

#include <vector>

#include "../runtime/arena_core.hpp"
#include "../runtime/dispatch_views.hpp"

namespace dc::bindings {

struct BoundArena {
  ArenaCore core;
  pybind11::object consumer;  // takes a DLPack capsule, returns the framework's tensor (torch's importer)
};

// The views `specs` of the reserved range (offset, size), each handed to the arena's consumer.
pybind11::tuple consume_views(BoundArena& a, int64_t offset, int64_t size, bool owned,
                              const std::vector<ArenaViewSpec>& specs);

// A dispatch's four outputs (x, scales, topk_idx, topk_weights; None where not returned) for n rows of the block.
pybind11::tuple dispatch_outputs(BoundArena& a, int64_t offset, int64_t size, bool owned, const DispatchOutputs& o,
                                 int64_t n);

}  // namespace dc::bindings
