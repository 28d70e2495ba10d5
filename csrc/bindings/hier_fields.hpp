// The fields of one hierarchical launch (csrc/kernels/hier_kernels.hpp) from the dict
// deepcomm/internode/hier_kernels.py
// passes: ints (pointers, sizes) and lists of ints; a missing key raises KeyError, a bad value ValueError. Shared
// by deepcomm._C (hier.cpp) and deepcomm._nvshmem_kernels (csrc/nvshmem_kernels/module.cpp).
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "../kernels/hier_kernels.hpp"
#include "../transport/device_qp_layout.hpp"

namespace dc::bindings::hier_fields {

namespace py = pybind11;
using namespace dc::transport;

template <typename T>
inline T get(const py::dict& d, const char* key) {
  if (!d.contains(key)) throw py::key_error(std::string("hier launch: missing field ") + key);
  return d[key].cast<T>();
}

template <typename T>
inline T* ptr(const py::dict& d, const char* key) {
  return reinterpret_cast<T*>(get<uintptr_t>(d, key));
}

// Copy a list of ints into a fixed array, refusing more than it holds.
template <typename T, size_t N>
inline void fill(T (&out)[N], const py::dict& d, const char* key, size_t want) {
  const auto v = get<std::vector<int64_t>>(d, key);
  if (v.size() != want || want > N)
    throw std::invalid_argument(std::string(key) + ": expected " + std::to_string(want) + " values (at most " +
                                std::to_string(N) + ")");
  for (size_t i = 0; i < v.size(); ++i) out[i] = T(v[i]);
}

inline HierTopo topo_of(const py::dict& d) {
  HierTopo t{get<int>(d, "num_nodes"), get<int>(d, "gpus"), get<int>(d, "node"), get<int>(d, "local"), 0};
  if (!internode_topology_fits(t.num_nodes, t.gpus) || t.gpus > kMaxNodeGpus)
    throw std::invalid_argument("hier launch: num_nodes must be in [1, " + std::to_string(kInternodeMaxNodes) +
                                "], gpus in [1, " + std::to_string(kMaxNodeGpus) + "] and num_nodes * gpus at most " +
                                std::to_string(kInternodeMaxRanks));
  t.rank = t.node * t.gpus + t.local;
  return t;
}

inline HierRdma rdma_of(const py::dict& d) {
  HierRdma r{};
  r.peers = ptr<const InternodePeer>(d, "peers");
  r.num_peers = get<int>(d, "num_peers");
  r.lkey = get<uint32_t>(d, "lkey");
  r.round = get<uint64_t>(d, "round");
  r.chunk_bytes = get<uint32_t>(d, "chunk_bytes");
  r.log_wqebbs = get<uint32_t>(d, "log_wqebbs");
  r.log_cqes = get<uint32_t>(d, "log_cqes");
  r.send = ptr<uint8_t>(d, "send");
  r.recv = ptr<const uint8_t>(d, "recv");
  r.signal = ptr<const uint64_t>(d, "signal");
  r.signal_target = get<uint64_t>(d, "signal_target");
  r.credit = ptr<uint64_t>(d, "credit");
  r.nvshmem_puts = get<bool>(d, "nvshmem_puts");
  r.slot_bytes = get<uint64_t>(d, "slot_bytes");
  r.header_bytes = get<uint32_t>(d, "header_bytes");
  r.emulate_nic = get<bool>(d, "emulate_nic");
  r.nic_blocks = get<int>(d, "nic_blocks");
  if (r.nic_blocks < 1 || r.nic_blocks > kNicMaxBlocks)
    throw std::invalid_argument("hier launch: nic_blocks must be in [1, " + std::to_string(kNicMaxBlocks) + "]");
  return r;
}

inline HierNode node_of(const py::dict& d, int gpus) {
  HierNode n{};
  const auto area = get<std::vector<uintptr_t>>(d, "area");
  const auto free_words = get<std::vector<uintptr_t>>(d, "free_words");
  const auto arrive_words = get<std::vector<uintptr_t>>(d, "arrive_words");
  if (int(area.size()) != gpus || int(free_words.size()) != gpus || int(arrive_words.size()) != gpus)
    throw std::invalid_argument("hier launch: area, free_words and arrive_words need one pointer per node GPU");
  for (int g = 0; g < gpus; ++g) {
    n.area[g] = reinterpret_cast<uint8_t*>(area[g]);
    n.free_words[g] = reinterpret_cast<uint64_t*>(free_words[g]);
    n.arrive_words[g] = reinterpret_cast<uint64_t*>(arrive_words[g]);
  }
  n.epoch = get<uint64_t>(d, "epoch");
  return n;
}

inline WaitCtx ctx_of(const py::dict& d, int rank) {
  return WaitCtx{ptr<ErrorRecord>(d, "err_dev"), uint64_t(get<double>(d, "timeout_s") * 1e9), rank, 0,
                 ptr<const uint64_t>(d, "seq_ptr")};
}

// The fields both launches share: topology, RDMA hop, NVLink hop, launch counters and the role split.
template <typename Args>
inline void fill_common(Args& a, const py::dict& d) {
  a.topo = topo_of(d);
  a.rdma = rdma_of(d);
  a.nvl = node_of(d, a.topo.gpus);
  a.counters = ptr<uint32_t>(d, "counters");
  a.rdma_blocks = get<int>(d, "rdma_blocks");
  a.nvl_blocks = get<int>(d, "nvl_blocks");
}

inline HierDispatchArgs dispatch_args(const py::dict& d) {
  HierDispatchArgs a{};
  fill_common(a, d);
  a.rows = ptr<const uint8_t>(d, "rows");
  a.stride = get<uint32_t>(d, "stride");
  a.mask_off = get<uint32_t>(d, "mask_off");
  a.num_tokens = get<int>(d, "num_tokens");
  a.masks = ptr<const int32_t>(d, "masks");
  a.rdma_slot = ptr<const int32_t>(d, "rdma_slot");
  fill(a.rows_to, d, "rows_to", size_t(a.topo.num_nodes));
  fill(a.rows_from, d, "rows_from", size_t(a.topo.num_nodes));
  a.first_row = ptr<const int32_t>(d, "first_row");
  a.route = ptr<int32_t>(d, "route");
  a.singles = ptr<int32_t>(d, "singles");
  a.max_rows = get<int>(d, "max_rows");
  return a;
}

inline HierCombineArgs combine_args(const py::dict& d) {
  HierCombineArgs a{};
  fill_common(a, d);
  a.held = ptr<const uint8_t>(d, "held");
  a.held_stride = get<uint32_t>(d, "held_stride");
  a.w_off = get<uint32_t>(d, "w_off");
  a.hidden = get<int>(d, "hidden");
  a.topk = get<int>(d, "topk");
  a.fp8 = get<bool>(d, "fp8");
  a.own_x = ptr<const uint16_t>(d, "own_x");
  a.own_w = ptr<const float>(d, "own_w");
  a.own_begin = get<int>(d, "own_begin");
  a.gather = ptr<const int64_t>(d, "gather");
  a.route = ptr<const int32_t>(d, "route");
  a.singles = ptr<const int32_t>(d, "singles");
  a.max_rows = get<int>(d, "max_rows");
  fill(a.rows_from, d, "rows_from", size_t(a.topo.num_nodes));
  a.area_off = ptr<const int64_t>(d, "area_off");
  a.partial_stride = get<uint32_t>(d, "partial_stride");
  a.recv_off = ptr<const int64_t>(d, "recv_off");
  a.num_tokens = get<int>(d, "num_tokens");
  a.out_x = ptr<uint16_t>(d, "out_x");
  a.out_w = ptr<float>(d, "out_w");
  return a;
}

}  // namespace dc::bindings::hier_fields
