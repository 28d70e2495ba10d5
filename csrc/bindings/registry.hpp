// The parts of deepcomm._C, one per subsystem, each in its own file of csrc/bindings/; module.cpp calls them in
// this order. Every binding takes raw pointers and streams as ints, except DispatchArgReader, which has torch
// describe its tensors through the DLPack exchange table (runtime/dlpack_abi.hpp); nothing links libtorch.
#pragma once
#include <pybind11/pybind11.h>

namespace dc::bindings {

void register_constants(pybind11::module_& m);    // constants.cpp: limits, WAIT_STAGES, LL_PHASES, DISPATCH_FLAGS
void register_runtime(pybind11::module_& m);      // runtime.cpp: device facts, memory, error and agreement records
void register_layouts(pybind11::module_& m);      // layouts.cpp: NVLink buffer, dispatch output, workspace,
                                                  // internode rows and regions
void register_nvlink(pybind11::module_& m);       // nvlink.cpp: the layout kernel, NvlContext (normal mode)
void register_low_latency(pybind11::module_& m);  // low_latency.cpp: LlContext
void register_arena(pybind11::module_& m);        // arena.cpp: ArenaCore (dispatch outputs as DLPack views)
void register_dispatch_args(pybind11::module_& m);  // dispatch_args.cpp: DispatchArgReader (a fresh dispatch's
                                                    // arguments checked and read in one crossing)
void register_owned_views(pybind11::module_& m);    // owned_views.cpp: OwnedViews (tensors with storages of their
                                                    // own over one owner's memory)

// transport.cpp: the submodule deepcomm._C.transport (mlx5 WQEs, host queue pair, emulated NIC, CPU proxy), then
// the parts below inside it.
void register_transport(pybind11::module_& m);
void register_device_qp(pybind11::module_& transport);  // device_qp.cpp: device queue pair layout and init
void register_internode(pybind11::module_& transport);  // internode.cpp: exchange round, node barrier, waits
void register_hier(pybind11::module_& transport);       // hier.cpp: hierarchical dispatch and combine launches

// nvshmem.cpp: deepcomm._C.nvshmem when built with the NVSHMEM headers, else only NVSHMEM_MISSING (the reason).
void register_nvshmem(pybind11::module_& m);

}  // namespace dc::bindings
