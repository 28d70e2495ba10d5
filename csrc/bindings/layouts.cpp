// deepcomm._C layouts: the NVLink buffer's, a dispatch output's and a fresh dispatch workspace's offsets, the
// combine row sizes, and the internode path's row sizes and regions, computed in C++ (the single source of offsets).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "../kernels/api.hpp"
#include "../kernels/node_barrier.hpp"
#include "../runtime/hier_route_layout.hpp"
#include "../runtime/hier_rows.hpp"
#include "../runtime/internode_layout.hpp"
#include "../runtime/internode_limits.hpp"
#include "../runtime/nvl_layout.hpp"
#include "layout_dict.hpp"
#include "registry.hpp"

namespace py = pybind11;

namespace dc::bindings {

namespace {

// The arguments of an RDMA transport's region: 1..kInternodeMaxRanks ranks, slots of a multiple of 16 bytes.
void check_region_args(int64_t world_size, int64_t slot_bytes) {
  if (world_size < 1 || world_size > kInternodeMaxRanks)
    throw py::value_error("world_size: expected 1.." + std::to_string(kInternodeMaxRanks) + ", got " +
                          std::to_string(world_size));
  if (slot_bytes < 0 || slot_bytes % 16)
    throw py::value_error("slot_bytes: expected a non-negative multiple of 16, got " + std::to_string(slot_bytes));
}

}  // namespace

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

  // ---- the internode path (runtime/internode_layout.hpp; deepcomm/internode/ caches them per argument tuple) ----
  m.def("internode_rows", [](int64_t max_tokens, int64_t hidden) {
    if (max_tokens < 0) throw py::value_error("max_tokens: expected >= 0, got " + std::to_string(max_tokens));
    if (hidden < 0) throw py::value_error("hidden: expected >= 0, got " + std::to_string(hidden));
    InternodeRows r(max_tokens, hidden);
    py::dict d;
    d["node_row"] = r.node_row; d["rail_row"] = r.rail_row; d["slot"] = r.slot;
    return d;
  }, py::arg("max_tokens"), py::arg("hidden"));
  // a fresh internode dispatch's route workspace and count row (runtime/hier_route_layout.hpp; int32 offsets)
  m.def("hier_route_work", [](int64_t tokens, int ranks, int gpus, int64_t num_experts, bool with_words) {
    if (tokens < 0) throw py::value_error("tokens: expected >= 0, got " + std::to_string(tokens));
    if (ranks < 1 || gpus < 1 || ranks % gpus)
      throw py::value_error("ranks, gpus: expected ranks a positive multiple of gpus, got " + std::to_string(ranks) +
                            ", " + std::to_string(gpus));
    if (num_experts < ranks || num_experts % ranks)
      throw py::value_error("num_experts: expected a positive multiple of ranks, got " + std::to_string(num_experts));
    const HierRouteWork w(tokens, ranks, gpus, num_experts, with_words);
    const HierCountRow& r = w.count_row;
    py::dict d;
    d["send_pos"] = w.send_pos; d["rdma_slot"] = w.rdma_slot; d["masks"] = w.masks; d["held_slot"] = w.held_slot;
    d["one_held"] = w.one_held; d["row"] = w.row;
    d["in_rank"] = w.in_rank; d["total"] = w.total;
    d["row_words"] = r.words; d["row_ranks"] = r.ranks; d["row_nodes"] = r.nodes; d["row_experts"] = r.experts;
    d["row_bad"] = r.bad; d["row_width"] = r.width;
    return d;
  }, py::arg("tokens"), py::arg("ranks"), py::arg("gpus"), py::arg("num_experts"), py::arg("with_words"));
  // the rows of the hierarchical kernels (runtime/hier_rows.hpp)
  m.def("hier_dispatch_row", [](int64_t x_bytes, int64_t scale_bytes, int64_t topk, bool with_idx, bool with_weights,
                                int gpus) {
    if (x_bytes < 0 || x_bytes % 4 || scale_bytes < 0 || scale_bytes % 4)
      throw py::value_error("x_bytes, scale_bytes: expected non-negative multiples of 4, got " +
                            std::to_string(x_bytes) + ", " + std::to_string(scale_bytes));
    if (topk < 0) throw py::value_error("topk: expected >= 0, got " + std::to_string(topk));
    if (gpus < 1) throw py::value_error("gpus: expected >= 1, got " + std::to_string(gpus));
    HierDispatchRow r(x_bytes, scale_bytes, topk, with_idx, with_weights, gpus);
    py::dict d;
    d["scale_off"] = r.scale_off; d["idx_off"] = r.idx_off; d["src_off"] = r.src_off; d["w_off"] = r.w_off;
    d["mask_off"] = r.mask_off; d["stride"] = r.stride;
    return d;
  }, py::arg("x_bytes"), py::arg("scale_bytes"), py::arg("topk"), py::arg("with_idx"), py::arg("with_weights"),
     py::arg("gpus"));
  m.def("hier_held_row", [](int64_t hidden, int64_t topk, bool fp8) {
    if (hidden < 1 || topk < 0) throw py::value_error("hidden, topk: expected >= 1 and >= 0");
    HierHeldRow r(hidden, topk, fp8);
    py::dict d;
    d["x_bytes"] = r.x_bytes; d["w_off"] = r.w_off; d["stride"] = r.stride;
    return d;
  }, py::arg("hidden"), py::arg("topk"), py::arg("fp8"));
  m.def("nic_region_layout", [](int64_t world_size, int64_t slot_bytes) {
    check_region_args(world_size, slot_bytes);
    NicRegion r(int(world_size), slot_bytes);
    py::dict d;
    d["signal"] = r.signal; d["credit"] = r.credit; d["fa_old"] = r.fa_old; d["send"] = r.send; d["recv"] = r.recv;
    d["total"] = r.total;
    return d;
  }, py::arg("world_size"), py::arg("slot_bytes"));
  m.def("nvshmem_region_layout", [](int64_t world_size, int64_t slot_bytes) {
    check_region_args(world_size, slot_bytes);
    NvshmemRegion r(int(world_size), slot_bytes);
    py::dict d;
    d["signal"] = r.signal; d["credit"] = r.credit; d["send"] = r.send; d["recv"] = r.recv; d["total"] = r.total;
    return d;
  }, py::arg("world_size"), py::arg("slot_bytes"));
  // The words strip of an area of area_bytes (several GPUs per node): its bytes, its offset in the area and the
  // slot of every rank (WordsStrip, runtime/internode_layout.hpp).
  m.def("words_strip", [](int64_t num_nodes, int64_t gpus_per_node, int64_t area_bytes) {
    if (num_nodes < 1 || gpus_per_node < 1 || num_nodes * gpus_per_node > kInternodeMaxRanks)
      throw py::value_error("num_nodes, gpus_per_node: expected >= 1 each and at most " +
                            std::to_string(kInternodeMaxRanks) + " ranks, got " + std::to_string(num_nodes) +
                            " x " + std::to_string(gpus_per_node));
    const WordsStrip w(int(num_nodes), int(gpus_per_node), area_bytes);
    if (w.at < 0) throw py::value_error("area_bytes: " + std::to_string(area_bytes) + " cannot hold the strip's " +
                                        std::to_string(w.bytes) + " bytes");
    py::list slots;
    for (int s = 0; s < w.nodes * w.gpus; ++s) slots.append(w.slot_of_rank(s));
    py::dict d;
    d["bytes"] = w.bytes; d["at"] = w.at; d["slots"] = py::tuple(slots);
    return d;
  }, py::arg("num_nodes"), py::arg("gpus_per_node"), py::arg("area_bytes"));
  m.def("node_link_layout", [](int64_t gpus_per_node, int64_t area_bytes) {
    if (gpus_per_node < 1 || gpus_per_node > kMaxNodeGpus)
      throw py::value_error("gpus_per_node: expected 1.." + std::to_string(kMaxNodeGpus) + ", got " +
                            std::to_string(gpus_per_node));
    if (area_bytes < 0) throw py::value_error("area_bytes: expected >= 0, got " + std::to_string(area_bytes));
    NodeLinkRegion r(int(gpus_per_node), area_bytes);
    py::dict d;
    d["flags"] = r.flags; d["free"] = r.free; d["arrive"] = r.arrive; d["area"] = r.area;
    d["area_bytes"] = r.area_bytes; d["total"] = r.total;
    return d;
  }, py::arg("gpus_per_node"), py::arg("area_bytes"));
}

}  // namespace dc::bindings
