// Registers deepcomm._C.transport: the mlx5 WQE encoder/decoder, a host queue pair, the emulated NIC and the
// CPU proxy, for host tests and CPU-side use. Called once from PYBIND11_MODULE in csrc/bindings.cpp.
#pragma once
#include <pybind11/pybind11.h>

void bind_transport(pybind11::module_& m);

// The device queue pair part of deepcomm._C.transport (csrc/transport/bindings_device_qp.cpp).
void bind_device_qp(pybind11::module_& m);

// The internode exchange round (csrc/transport/bindings_internode.cpp).
void bind_internode(pybind11::module_& m);

// The hierarchical internode dispatch and combine kernels (csrc/transport/bindings_hier.cpp).
void bind_hier(pybind11::module_& m);
