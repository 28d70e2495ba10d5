// deepcomm._C.transport, hierarchical kernels (csrc/kernels/hier_kernels.hpp): the launch of one internode
// dispatch or combine. The Python side (deepcomm/internode/hier_kernels.py) builds the typed arguments
// (hier_launch.hpp: HierLaunch, HierDispatchLaunch, HierCombineLaunch, every field a keyword, checked when built).
#include <pybind11/stl.h>

#include <optional>

#include "../kernels/hier_kernels.hpp"
#include "../kernels/hier_route.hpp"
#include "../transport/device_qp_layout.hpp"
#include "args.hpp"
#include "hier_launch.hpp"
#include "registry.hpp"
#include "typed_args.hpp"

namespace py = pybind11;
using namespace dc;
using namespace dc::transport;

namespace {

void register_launch_args(py::module_& m) {
  using L = dc::bindings::HierLaunch;
  dc::bindings::ArgsClass<L>(m, "HierLaunch", "What every hierarchical launch shares (hier_kernels.hpp HierTopo, "
                                              "HierRdma, HierNode, the counters and role split, the wait context)")
      .field("num_nodes", &L::num_nodes).field("gpus", &L::gpus).field("node", &L::node).field("local", &L::local)
      .field("peers", &L::peers).field("num_peers", &L::num_peers).field("lkey", &L::lkey).field("round", &L::round)
      .field("chunk_bytes", &L::chunk_bytes).field("log_wqebbs", &L::log_wqebbs).field("log_cqes", &L::log_cqes)
      .field("send", &L::send).field("recv", &L::recv).field("signal", &L::signal)
      .field("signal_target", &L::signal_target).field("credit", &L::credit).field("nvshmem_puts", &L::nvshmem_puts)
      .field("slot_bytes", &L::slot_bytes).field("header_bytes", &L::header_bytes)
      .field("emulate_nic", &L::emulate_nic).field("nic_blocks", &L::nic_blocks)
      .field("area", &L::area).field("free_words", &L::free_words).field("arrive_words", &L::arrive_words)
      .field("epoch", &L::epoch).field("words_at", &L::words_at).field("counters", &L::counters)
      .field("counters_next", &L::counters_next).field("rdma_blocks", &L::rdma_blocks)
      .field("nvl_blocks", &L::nvl_blocks).field("err_dev", &L::err_dev).field("timeout_s", &L::timeout_s).done();

  using D = dc::bindings::HierDispatchLaunch;
  dc::bindings::ArgsClass<D>(m, "HierDispatchLaunch", "One hierarchical dispatch (hier_kernels.hpp HierDispatchArgs)")
      .field("common", &D::common).field("x", &D::x).field("scales", &D::scales).field("topk_idx", &D::topk_idx)
      .field("topk_weights", &D::topk_weights).field("x_bytes", &D::x_bytes).field("scale_bytes", &D::scale_bytes)
      .field("topk", &D::topk).field("with_idx", &D::with_idx).field("with_weights", &D::with_weights)
      .field("num_tokens", &D::num_tokens).field("out_x", &D::out_x).field("out_scales", &D::out_scales)
      .field("out_topk_idx", &D::out_topk_idx).field("out_src_idx", &D::out_src_idx)
      .field("out_weights", &D::out_weights).field("first_expert", &D::first_expert)
      .field("local_experts", &D::local_experts).field("num_recv", &D::num_recv).field("masks", &D::masks)
      .field("rdma_slot", &D::rdma_slot).field("rows_to", &D::rows_to).field("rows_from", &D::rows_from)
      .field("first_row", &D::first_row).field("route", &D::route).field("singles", &D::singles)
      .field("max_rows", &D::max_rows)
      .done();

  using Cb = dc::bindings::HierCombineLaunch;
  dc::bindings::ArgsClass<Cb>(m, "HierCombineLaunch", "One hierarchical combine (hier_kernels.hpp HierCombineArgs)")
      .field("common", &Cb::common).field("held_stride", &Cb::held_stride)
      .field("w_off", &Cb::w_off).field("hidden", &Cb::hidden).field("topk", &Cb::topk).field("fp8", &Cb::fp8)
      .field("own_x", &Cb::own_x).field("own_w", &Cb::own_w).field("own_begin", &Cb::own_begin)
      .field("gather", &Cb::gather).field("route", &Cb::route).field("singles", &Cb::singles)
      .field("max_rows", &Cb::max_rows).field("rows_from", &Cb::rows_from).field("area_off", &Cb::area_off)
      .field("partial_stride", &Cb::partial_stride).field("rdma_slot", &Cb::rdma_slot)
      .field("held_slot", &Cb::held_slot).field("one_held", &Cb::one_held)
      .field("num_tokens", &Cb::num_tokens).field("out_x", &Cb::out_x).field("out_w", &Cb::out_w)
      .done();
}

}  // namespace

void dc::bindings::register_hier(py::module_& m) {
  m.attr("HIER_MAX_NODES") = kHierMaxNodes;
  m.attr("INTERNODE_MAX_RANKS") = kInternodeMaxRanks;  // runtime/internode_limits.hpp
  m.attr("INTERNODE_MAX_NODES") = kInternodeMaxNodes;
  m.attr("KEY_TABLE_REGIONS") = kMaxRegions;           // transport/key_table.hpp: ours + one per rail peer
  m.attr("STAGE_HIER_FREE") = int(kStageHierFree);
  m.attr("STAGE_HIER_ARRIVE") = int(kStageHierArrive);
  m.attr("STAGE_HIER_LOCAL") = int(kStageHierLocal);
  m.attr("NVSHMEM_CHUNKS") = kNvshmemChunks;  // put-with-signal chunks per rail block (hier_kernels.hpp)
  register_launch_args(m);

  m.def("hier_dispatch", [](const HierDispatchLaunch& l, const KeyTable& keys, uintptr_t stream) {
    launch_hier_dispatch(l.args(), keys, l.common.wait_ctx(), reinterpret_cast<cudaStream_t>(stream));
  }, py::arg("launch"), py::arg("keys"), py::arg("stream"),
     "Launch one hierarchical internode dispatch (csrc/kernels/hier_kernels.hpp).");

  m.def("hier_route", [](uintptr_t topk_idx, int64_t num_tokens, int topk, int64_t num_experts, int ranks, int gpus,
                         std::optional<dc::bindings::Words> words, uintptr_t work, uintptr_t stream) {
    HierRouteArgs a{};
    a.topk_idx = reinterpret_cast<const int64_t*>(topk_idx);
    a.num_tokens = num_tokens; a.topk = topk; a.num_experts = num_experts; a.ranks = ranks; a.gpus = gpus;
    a.with_words = words.has_value();
    if (words) a.words = dc::bindings::fingerprint_of(*words);
    a.work = reinterpret_cast<int32_t*>(work);
    launch_hier_route(a, reinterpret_cast<cudaStream_t>(stream));
  }, py::arg("topk_idx"), py::arg("num_tokens"), py::arg("topk"), py::arg("num_experts"), py::arg("ranks"),
     py::arg("gpus"), py::arg("words"), py::arg("work"), py::arg("stream"),
     "Queue a fresh internode dispatch's route and count row into `work` (csrc/kernels/hier_route.hpp).");

  m.def("hier_combine", [](const HierCombineLaunch& l, const KeyTable& keys, uintptr_t stream) {
    launch_hier_combine(l.args(), keys, l.common.wait_ctx(), reinterpret_cast<cudaStream_t>(stream));
  }, py::arg("launch"), py::arg("keys"), py::arg("stream"),
     "Launch one hierarchical internode combine (csrc/kernels/hier_kernels.hpp).");
}
