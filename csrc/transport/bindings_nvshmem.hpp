// Registers deepcomm._C.nvshmem (NVSHMEM host calls on raw pointers and bytes) when the extension was built with
// the NVSHMEM headers; otherwise only deepcomm._C.NVSHMEM_MISSING, the reason. Called from csrc/bindings.cpp.
#pragma once
#include <pybind11/pybind11.h>

void bind_nvshmem(pybind11::module_& m);
