// deepcomm._C layouts: the NVLink buffer's and a dispatch output's offsets, and the combine row sizes, computed in
// C++ (the single source of offsets).
#include <pybind11/pybind11.h>

#include <cstdint>

#include "../kernels/api.hpp"
#include "../runtime/nvl_layout.hpp"
#include "layout_dict.hpp"
#include "registry.hpp"

namespace py = pybind11;

namespace dc::bindings {

void register_layouts(py::module_& m) {
  // ---- layout math (the single source of offsets) ----
  m.def("nvl_layout", [](int ranks, int local_experts_cap, int max_tokens, int64_t hidden, int64_t topk,
                         int64_t arena) { return layout_dict(NvlLayout(ranks, local_experts_cap, max_tokens, hidden, topk, arena)); });
  m.def("dispatch_out_layout", [](int64_t n, int64_t x_row_bytes, int64_t scale_row_bytes, int64_t topk) {
    DispatchOutLayout o(n, x_row_bytes, scale_row_bytes, topk);
    py::dict d;
    d["x"] = o.x; d["scales"] = o.scales; d["topk_idx"] = o.topk_idx; d["topk_weights"] = o.topk_weights;
    d["src_idx"] = o.src_idx; d["total"] = o.total;
    return d;
  });
  m.def("combine_row_bytes", &combine_row_bytes);
  m.def("combine_fp8_row_bytes", &combine_fp8_row_bytes);
}

}  // namespace dc::bindings
