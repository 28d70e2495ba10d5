// deepcomm._C.transport, internode part: one round of the internode exchange (csrc/kernels/internode_exchange.hpp),
// the node barrier, the bounded waits, the tagged words to host memory (csrc/kernels/host_words.hpp) and the record
// layouts the Python side reads. Pointers are ints; streams are ints.
#include <pybind11/stl.h>

#include "../kernels/counter_wait.hpp"
#include "../kernels/host_words.hpp"
#include "../kernels/internode_exchange.hpp"
#include "../kernels/node_barrier.hpp"
#include "../runtime/cuda_check.hpp"
#include "../transport/device_qp_layout.hpp"
#include "registry.hpp"

namespace py = pybind11;
using namespace dc;
using namespace dc::transport;

// The bounded waits of one launch: the host-mapped error record, the timeout, our rank, and the launch's number
// (its round or epoch, which the host knows: the kernels take it as is, with no device counter to fill first).
static WaitCtx wait_ctx(uintptr_t err_dev, double timeout_s, int rank, uint64_t seq) {
  return WaitCtx{reinterpret_cast<ErrorRecord*>(err_dev), uint64_t(timeout_s * 1e9), rank, seq, nullptr};
}

void dc::bindings::register_internode(py::module_& m) {
  m.attr("INTERNODE_PEER_FIELDS") = kInternodePeerFields;
  m.attr("NIC_TOTALS_FIELDS") = py::make_tuple("wqes", "bytes", "writes", "atomics");
  m.attr("NIC_TOTALS_BYTES") = sizeof(NicTotals);
  m.attr("NIC_CREW_BYTES") = sizeof(NicCrew);
  m.attr("NIC_MAX_BLOCKS") = kNicMaxBlocks;
  m.def("internode_exchange", [](uintptr_t peers, int num_peers, uint32_t lkey, uint64_t round, uint32_t chunk_bytes,
                                 uint32_t log_wqebbs, uint32_t log_cqes, const KeyTable& keys, uintptr_t err_dev,
                                 double timeout_s, int rank, uintptr_t stream, int nic_blocks) {
    if (log_wqebbs < 2 || log_wqebbs > kMaxLogWqebbs || log_cqes < log_wqebbs || log_cqes > kMaxLogCqes)
      throw std::invalid_argument("log_wqebbs must be in [2, 15] and log_cqes in [log_wqebbs, 16]");
    InternodeExchangeArgs a{};
    a.peers = reinterpret_cast<const InternodePeer*>(peers);
    a.num_peers = num_peers;
    a.lkey = lkey;
    a.round = round;
    a.chunk_bytes = chunk_bytes;
    a.log_wqebbs = log_wqebbs;
    a.log_cqes = log_cqes;
    a.nic_blocks = nic_blocks;
    launch_internode_exchange(a, keys, wait_ctx(err_dev, timeout_s, rank, round),
                              reinterpret_cast<cudaStream_t>(stream));
  }, py::arg("peers"), py::arg("num_peers"), py::arg("lkey"), py::arg("round"), py::arg("chunk_bytes"),
     py::arg("log_wqebbs"), py::arg("log_cqes"), py::arg("keys"), py::arg("err_dev"), py::arg("timeout_s"),
     py::arg("rank"), py::arg("stream"), py::arg("nic_blocks") = 1,
     "Launch one exchange round; peers: device int64 [num_peers][INTERNODE_PEER_FIELDS] (InternodePeer); "
     "nic_blocks: blocks per queue pair's emulated NIC, 1..NIC_MAX_BLOCKS.");

  // The NVLink hop of the hierarchical exchange: a bounded barrier among the GPUs of a node.
  m.attr("STAGE_NODE_BARRIER") = int(kStageNodeBarrier);
  m.attr("MAX_NODE_GPUS") = kMaxNodeGpus;
  m.def("node_barrier", [](uintptr_t flags, const std::vector<uintptr_t>& peer_flags, int local, int first_rank,
                           uint64_t epoch, uintptr_t err_dev, double timeout_s, uintptr_t stream) {
    if (peer_flags.empty() || peer_flags.size() > size_t(kMaxNodeGpus))
      throw std::invalid_argument("peer_flags: one pointer per GPU of the node, 1.." + std::to_string(kMaxNodeGpus));
    if (local < 0 || size_t(local) >= peer_flags.size()) throw std::invalid_argument("local: outside [0, gpus)");
    NodeBarrierArgs a{};
    a.flags = reinterpret_cast<uint64_t*>(flags);
    for (size_t i = 0; i < peer_flags.size(); ++i) a.peer_flags[i] = reinterpret_cast<uint64_t*>(peer_flags[i]);
    a.gpus = int(peer_flags.size());
    a.local = local;
    a.first_rank = first_rank;
    a.epoch = epoch;
    launch_node_barrier(a, wait_ctx(err_dev, timeout_s, first_rank + local, epoch),
                        reinterpret_cast<cudaStream_t>(stream));
  }, py::arg("flags"), py::arg("peer_flags"), py::arg("local"), py::arg("first_rank"), py::arg("epoch"),
     py::arg("err_dev"), py::arg("timeout_s"), py::arg("stream"),
     "Launch one barrier among the GPUs of a node (csrc/kernels/node_barrier.hpp); flags: our u64 [gpus].");

  // Words the host learns through mapped memory, tagged (csrc/kernels/host_words.hpp; deepcomm/internode/
  // mapped_words.py).
  m.def("host_words_bytes", &host_words_bytes, py::arg("n"), "Bytes of the mapped block for n int32 words.");
  m.def("words_to_host", [](uintptr_t src, int64_t n, uintptr_t mapped_dev, uint64_t tag, uintptr_t stream) {
    launch_words_to_host(reinterpret_cast<const int32_t*>(src), n, reinterpret_cast<uint8_t*>(mapped_dev), tag,
                         reinterpret_cast<cudaStream_t>(stream));
  }, py::arg("src"), py::arg("n"), py::arg("mapped_dev"), py::arg("tag"), py::arg("stream"),
     "Queue the copy of n device int32 words at src into the mapped block (its device address), then its tag.");
  m.def("wait_host_words", [](uintptr_t mapped_host, uint64_t tag, int64_t n, double timeout_s,
                              const std::vector<uintptr_t>& error_records) {
    if (n < 0) throw std::invalid_argument("n: expected >= 0");
    std::vector<const ErrorRecord*> errors;
    for (uintptr_t e : error_records) errors.push_back(reinterpret_cast<const ErrorRecord*>(e));
    HostTagWait status;
    {
      py::gil_scoped_release release;  // other Python threads run while we wait
      status = wait_host_tag(reinterpret_cast<const uint8_t*>(mapped_host), tag, timeout_s, errors);
    }
    py::list words;
    if (status == kHostTagArrived) {
      const auto* w = reinterpret_cast<const int32_t*>(mapped_host + kHostWordsOffset);
      for (int64_t i = 0; i < n; ++i) words.append(w[i]);
    }
    return py::make_tuple(int(status), words);
  }, py::arg("mapped_host"), py::arg("tag"), py::arg("n"), py::arg("timeout_s"), py::arg("error_records"),
     "Wait (GIL released, bounded) until the mapped block's tag equals tag: (0, its n words); (1, []) when an error "
     "record's flag is set first; (2, []) after timeout_s.");

  // The NVSHMEM transport's bounded waits (csrc/kernels/counter_wait.hpp) and the stages they record.
  m.attr("STAGE_NVSHMEM_CREDIT") = int(kStageNvshmemCredit);
  m.attr("STAGE_NVSHMEM_SIGNAL") = int(kStageNvshmemSignal);
  m.attr("MAX_COUNTER_WAIT_RANKS") = kMaxCounterWaitRanks;
  m.def("wait_counters", [](uintptr_t counters, int world_size, int rank, const std::vector<int>& peers,
                            uint64_t target, int stage, uintptr_t err_dev, double timeout_s, uint64_t seq,
                            uintptr_t stream) {
    CounterWaitArgs a{reinterpret_cast<const uint64_t*>(counters), world_size, rank, target, stage, {}};
    for (int p : peers) {
      if (p < 0 || p >= world_size || p == rank)
        throw std::invalid_argument("peers: rank " + std::to_string(p) + " outside [0, world_size) or our own");
      a.peer_mask[p / 32] |= 1u << (p % 32);
    }
    launch_counter_wait(a, wait_ctx(err_dev, timeout_s, rank, seq), reinterpret_cast<cudaStream_t>(stream));
  }, py::arg("counters"), py::arg("world_size"), py::arg("rank"), py::arg("peers"), py::arg("target"),
     py::arg("stage"), py::arg("err_dev"), py::arg("timeout_s"), py::arg("seq"), py::arg("stream"),
     "Launch a bounded wait until counters[p] >= target for every p in peers (device u64 [world_size]); a "
     "timeout is recorded in the error record with `stage`.");
}
