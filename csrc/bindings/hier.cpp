// deepcomm._C.transport, hierarchical kernels (csrc/kernels/hier_kernels.hpp): the launch of one internode
// dispatch or combine. The Python side (deepcomm/internode/hier_kernels.py) passes the launch's fields as a dict of
// ints (pointers, sizes) and lists of ints; a missing key raises KeyError, a bad value ValueError.
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "../kernels/hier_kernels.hpp"
#include "../transport/device_qp_layout.hpp"
#include "hier_fields.hpp"
#include "registry.hpp"

namespace py = pybind11;
using namespace dc;
using namespace dc::transport;
using namespace dc::bindings::hier_fields;

void dc::bindings::register_hier(py::module_& m) {
  m.attr("HIER_MAX_NODES") = kHierMaxNodes;
  m.attr("INTERNODE_MAX_RANKS") = kInternodeMaxRanks;  // runtime/internode_limits.hpp
  m.attr("INTERNODE_MAX_NODES") = kInternodeMaxNodes;
  m.attr("KEY_TABLE_REGIONS") = kMaxRegions;           // transport/key_table.hpp: ours + one per rail peer
  m.attr("STAGE_HIER_FREE") = int(kStageHierFree);
  m.attr("STAGE_HIER_ARRIVE") = int(kStageHierArrive);
  m.attr("STAGE_HIER_LOCAL") = int(kStageHierLocal);
  m.attr("NVSHMEM_CHUNKS") = kNvshmemChunks;  // put-with-signal chunks per rail block (hier_kernels.hpp)

  m.def("hier_dispatch", [](const py::dict& d, const KeyTable& keys, uintptr_t stream) {
    const HierDispatchArgs a = dispatch_args(d);
    launch_hier_dispatch(a, keys, ctx_of(d, a.topo.rank), reinterpret_cast<cudaStream_t>(stream));
  }, py::arg("fields"), py::arg("keys"), py::arg("stream"),
     "Launch one hierarchical internode dispatch (csrc/kernels/hier_kernels.hpp); fields: a dict of ints.");

  m.def("hier_combine", [](const py::dict& d, const KeyTable& keys, uintptr_t stream) {
    const HierCombineArgs a = combine_args(d);
    launch_hier_combine(a, keys, ctx_of(d, a.topo.rank), reinterpret_cast<cudaStream_t>(stream));
  }, py::arg("fields"), py::arg("keys"), py::arg("stream"),
     "Launch one hierarchical internode combine (csrc/kernels/hier_kernels.hpp); fields: a dict of ints.");
}
