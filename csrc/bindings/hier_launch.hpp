// The typed arguments of one hierarchical launch (csrc/kernels/hier_kernels.hpp) as Python builds them: pointers
// as ints, per-node and per-GPU values as lists. Each is checked when built (check(): a py::value_error naming the
// field) and turned into the kernel's argument struct at the launch. deepcomm._C.transport binds the classes
// (hier.cpp); deepcomm._nvshmem_kernels (csrc/nvshmem_kernels/module.cpp) takes the same objects.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../kernels/hier_kernels.hpp"
#include "../kernels/topk_max.hpp"
#include "../transport/device_qp_layout.hpp"

namespace dc::bindings {

namespace hier_detail {

[[noreturn]] inline void bad(const std::string& what) { throw pybind11::value_error("hier launch: " + what); }

// Copy a list of ints into a fixed per-node array (the length checked by check()).
template <typename T, size_t N>
inline void fill(T (&out)[N], const std::vector<int64_t>& v) {
  for (size_t i = 0; i < v.size() && i < N; ++i) out[i] = T(v[i]);
}

template <typename T>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

}  // namespace hier_detail

// What every launch shares: topology, RDMA hop (HierRdma), NVLink hop (HierNode), launch counters and the role
// split, and the wait context.
struct HierLaunch {
  int num_nodes = 0, gpus = 0, node = 0, local = 0;
  // RDMA hop
  uintptr_t peers = 0;
  int num_peers = 0;
  uint32_t lkey = 0;
  uint64_t round = 0;
  uint32_t chunk_bytes = 0, log_wqebbs = 0, log_cqes = 0;
  uintptr_t send = 0, recv = 0, signal = 0;
  uint64_t signal_target = 0;
  uintptr_t credit = 0;
  bool nvshmem_puts = false;
  uint64_t slot_bytes = 0;
  uint32_t header_bytes = 0;
  bool emulate_nic = false;
  int nic_blocks = 1;
  // NVLink hop: one pointer per node GPU each
  std::vector<uintptr_t> area, free_words, arrive_words;
  uint64_t epoch = 0;
  int64_t words_at = -1;  // the words strip's offset in every area, or -1 (hier_kernels.hpp HierNode)
  // launch
  uintptr_t counters = 0;       // this launch's block-done counters [4], zero at its start
  uintptr_t counters_next = 0;  // the next launch's [4], zeroed by this one at entry (its own were, by the last)
  int rdma_blocks = 0, nvl_blocks = 0;
  // waits
  uintptr_t err_dev = 0;
  double timeout_s = 0;

  void check() const {
    using hier_detail::bad;
    if (!internode_topology_fits(num_nodes, gpus) || gpus > kMaxNodeGpus)
      bad("num_nodes must be in [1, " + std::to_string(kInternodeMaxNodes) + "], gpus in [1, " +
          std::to_string(kMaxNodeGpus) + "] and num_nodes * gpus at most " + std::to_string(kInternodeMaxRanks));
    if (node < 0 || node >= num_nodes) bad("node must be in [0, num_nodes)");
    if (local < 0 || local >= gpus) bad("local must be in [0, gpus)");
    if (num_peers < 0) bad("num_peers must be >= 0");
    if (nic_blocks < 1 || nic_blocks > transport::kNicMaxBlocks)
      bad("nic_blocks must be in [1, " + std::to_string(transport::kNicMaxBlocks) + "]");
    const size_t G = size_t(gpus);
    if (area.size() != G) bad("area needs one pointer per node GPU");
    if (free_words.size() != G) bad("free_words needs one pointer per node GPU");
    if (arrive_words.size() != G) bad("arrive_words needs one pointer per node GPU");
    if (words_at < -1 || (words_at >= 0 && words_at % 16 != 0)) bad("words_at must be -1 or a multiple of 16");
    if (rdma_blocks < 1) bad("rdma_blocks must be >= 1");
    if (nvl_blocks < 1) bad("nvl_blocks must be >= 1");
    if (!(timeout_s >= 0)) bad("timeout_s must be >= 0");
  }
  HierTopo topo() const { return HierTopo{num_nodes, gpus, node, local, node * gpus + local}; }
  HierRdma rdma() const {
    using hier_detail::ptr;
    HierRdma r{};
    r.peers = ptr<const InternodePeer>(peers);
    r.num_peers = num_peers;
    r.lkey = lkey;
    r.round = round;
    r.chunk_bytes = chunk_bytes;
    r.log_wqebbs = log_wqebbs;
    r.log_cqes = log_cqes;
    r.send = ptr<uint8_t>(send);
    r.recv = ptr<const uint8_t>(recv);
    r.signal = ptr<const uint64_t>(signal);
    r.signal_target = signal_target;
    r.credit = ptr<uint64_t>(credit);
    r.nvshmem_puts = nvshmem_puts;
    r.slot_bytes = slot_bytes;
    r.header_bytes = header_bytes;
    r.emulate_nic = emulate_nic;
    r.nic_blocks = nic_blocks;
    return r;
  }
  HierNode node_link() const {
    HierNode n{};
    for (int g = 0; g < gpus; ++g) {
      n.area[g] = hier_detail::ptr<uint8_t>(area[size_t(g)]);
      n.free_words[g] = hier_detail::ptr<uint64_t>(free_words[size_t(g)]);
      n.arrive_words[g] = hier_detail::ptr<uint64_t>(arrive_words[size_t(g)]);
    }
    n.epoch = epoch;
    n.words_at = words_at;
    return n;
  }
  WaitCtx wait_ctx() const {
    // the launch's number is its exchange round, known to the host (no device counter to read or fill)
    return WaitCtx{hier_detail::ptr<ErrorRecord>(err_dev), uint64_t(timeout_s * 1e9), node * gpus + local, round,
                   nullptr};
  }
  // The fields of HierDispatchArgs / HierCombineArgs this part holds.
  template <typename Args>
  void fill(Args& a) const {
    a.topo = topo();
    a.rdma = rdma();
    a.nvl = node_link();
    a.counters = hier_detail::ptr<uint32_t>(counters);
    a.counters_next = hier_detail::ptr<uint32_t>(counters_next);
    a.rdma_blocks = rdma_blocks;
    a.nvl_blocks = nvl_blocks;
  }
};

// One per-node list of row counts: num_nodes values, each in [0, 2^31).
inline void check_node_rows(const std::vector<int64_t>& v, int num_nodes, const char* name) {
  if (v.size() != size_t(num_nodes))
    hier_detail::bad(std::string(name) + ": expected " + std::to_string(num_nodes) + " values (one per node)");
  for (int64_t n : v)
    if (n < 0 || n > INT32_MAX) hier_detail::bad(std::string(name) + ": row counts must be in [0, 2^31)");
}

// HierDispatchArgs: the shared part, then the caller's tensors a row is built from, the output tensors the
// received rows are split into (runtime/hier_rows.hpp: the row is HierDispatchRow(x_bytes, scale_bytes, topk,
// with_idx, with_weights, gpus)), and the routing.
struct HierDispatchLaunch {
  HierLaunch common;
  uintptr_t x = 0, scales = 0, topk_idx = 0, topk_weights = 0;
  int64_t x_bytes = 0, scale_bytes = 0;
  int topk = 0;
  bool with_idx = false, with_weights = false;
  int num_tokens = 0;
  uintptr_t out_x = 0, out_scales = 0, out_topk_idx = 0, out_src_idx = 0, out_weights = 0;
  int64_t first_expert = 0, local_experts = 0;  // HierRecvDst: local_experts > 0 makes the received ids local
  int num_recv = 0;
  uintptr_t masks = 0, rdma_slot = 0;
  std::vector<int64_t> rows_to, rows_from;
  uintptr_t first_row = 0, route = 0, singles = 0;
  int max_rows = 0;

  void check() const {
    using hier_detail::bad;
    common.check();
    if (x_bytes < 16 || x_bytes % 16) bad("x_bytes must be a positive multiple of 16");
    if (scale_bytes < 0 || scale_bytes % 4) bad("scale_bytes must be a non-negative multiple of 4");
    if (topk < 0 || topk > kTopkMax) bad("topk must be in [0, " + std::to_string(kTopkMax) + "]");
    if (num_tokens < 0) bad("num_tokens must be >= 0");
    if (num_recv < 0) bad("num_recv must be >= 0");
    if (local_experts < 0 || first_expert < 0) bad("first_expert and local_experts must be >= 0");
    if (max_rows < 0) bad("max_rows must be >= 0");
    check_node_rows(rows_to, common.num_nodes, "rows_to");
    check_node_rows(rows_from, common.num_nodes, "rows_from");
  }
  HierDispatchRow row() const {
    return HierDispatchRow(x_bytes, scale_bytes, topk, with_idx, with_weights, common.gpus);
  }
  HierDispatchArgs args() const {
    check();
    using hier_detail::ptr;
    HierDispatchArgs a{};
    common.fill(a);
    a.row = row();
    a.src = HierRowSrc{ptr<const uint8_t>(x), ptr<const uint8_t>(scales), ptr<const int64_t>(topk_idx),
                       ptr<const float>(topk_weights)};
    a.stride = uint32_t(a.row.stride);
    a.mask_off = uint32_t(a.row.mask_off);
    a.num_tokens = num_tokens;
    a.out = HierRecvDst{ptr<uint8_t>(out_x), ptr<uint8_t>(out_scales), ptr<int64_t>(out_topk_idx),
                        ptr<int32_t>(out_src_idx), ptr<float>(out_weights), first_expert, local_experts};
    a.num_recv = num_recv;
    a.masks = ptr<const int32_t>(masks);
    a.rdma_slot = ptr<const int32_t>(rdma_slot);
    hier_detail::fill(a.rows_to, rows_to);
    hier_detail::fill(a.rows_from, rows_from);
    a.first_row = ptr<const int32_t>(first_row);
    a.route = ptr<int32_t>(route);
    a.singles = ptr<int32_t>(singles);
    a.max_rows = max_rows;
    return a;
  }
};

// HierCombineArgs: the shared part, then the held rows, the dispatch's route and the outputs.
struct HierCombineLaunch {
  HierLaunch common;
  uint32_t held_stride = 0, w_off = 0;
  int hidden = 0, topk = 0;
  bool fp8 = false;
  uintptr_t own_x = 0, own_w = 0;
  int own_begin = 0;
  uintptr_t gather = 0, route = 0, singles = 0;
  int max_rows = 0;
  std::vector<int64_t> rows_from;
  uintptr_t area_off = 0;
  uint32_t partial_stride = 0;
  uintptr_t rdma_slot = 0, held_slot = 0, one_held = 0;
  int num_tokens = 0;
  uintptr_t out_x = 0, out_w = 0;

  void check() const {
    common.check();
    if (hidden < 1) hier_detail::bad("hidden must be >= 1");
    if (topk < 0) hier_detail::bad("topk must be >= 0");
    if (num_tokens < 0) hier_detail::bad("num_tokens must be >= 0");
    if (own_begin < 0) hier_detail::bad("own_begin must be >= 0");
    if (max_rows < 0) hier_detail::bad("max_rows must be >= 0");
    check_node_rows(rows_from, common.num_nodes, "rows_from");
    if (num_tokens > 0 && (rdma_slot == 0 || held_slot == 0 || (common.gpus > 1 && one_held == 0)))
      hier_detail::bad("rdma_slot, held_slot (and one_held with gpus > 1) are needed with tokens");
  }
  HierCombineArgs args() const {
    check();
    using hier_detail::ptr;
    HierCombineArgs a{};
    common.fill(a);
    a.held_stride = held_stride;
    a.w_off = w_off;
    a.hidden = hidden;
    a.topk = topk;
    a.fp8 = fp8;
    a.own_x = ptr<const uint16_t>(own_x);
    a.own_w = ptr<const float>(own_w);
    a.own_begin = own_begin;
    a.gather = ptr<const int64_t>(gather);
    a.route = ptr<const int32_t>(route);
    a.singles = ptr<const int32_t>(singles);
    a.max_rows = max_rows;
    hier_detail::fill(a.rows_from, rows_from);
    a.area_off = ptr<const int64_t>(area_off);
    a.partial_stride = partial_stride;
    a.rdma_slot = ptr<const int32_t>(rdma_slot);
    a.held_slot = ptr<const int32_t>(held_slot);
    a.one_held = ptr<const int32_t>(one_held);
    a.num_tokens = num_tokens;
    a.out_x = ptr<uint16_t>(out_x);
    a.out_w = ptr<float>(out_w);
    return a;
  }
};

}  // namespace dc::bindings
