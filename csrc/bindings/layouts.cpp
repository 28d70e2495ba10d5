// deepcomm._C layouts: the NVLink buffer's, a dispatch output's and a fresh dispatch workspace's offsets, and the
// combine row sizes, computed in C++ (the single source of offsets).
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
  // a fresh dispatch's int32 workspace (offsets in int32 elements; deepcomm/nvlink/backend.py caches them)
  m.def("fresh_dispatch_work", [](int64_t tokens, int ranks, int local_experts, int64_t rows) {
    if (tokens < 0 || ranks < 1 || local_experts < 0 || rows < 0)
      throw py::value_error("fresh_dispatch_work: tokens, local_experts and rows must be >= 0, ranks >= 1");
    FreshDispatchWork w(tokens, ranks, local_experts, rows);
    py::dict d;
    d["send_pos"] = w.send_pos; d["notify_out"] = w.notify_out; d["count_matrix"] = w.count_matrix;
    d["per_expert"] = w.per_expert; d["bad_all"] = w.bad_all; d["src_idx"] = w.src_idx; d["in_rank"] = w.in_rank;
    d["total"] = w.total;
    return d;
  }, py::arg("tokens"), py::arg("ranks"), py::arg("local_experts"), py::arg("rows"));
  m.def("combine_row_bytes", &combine_row_bytes);
  m.def("combine_fp8_row_bytes", &combine_fp8_row_bytes);
}

}  // namespace dc::bindings
