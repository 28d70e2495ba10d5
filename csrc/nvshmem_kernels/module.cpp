// deepcomm._nvshmem_kernels: the hierarchical internode kernels (csrc/kernels/hier_{dispatch,combine}.cu, compiled a
// second time with DEEPCOMM_NVSHMEM_DEVICE) whose poster issues NVSHMEM device puts (hier_nvshmem_poster.cuh), and
// the transport's own exchange round issued from the GPU (rail_round.hpp).
// Optional: built only where NVSHMEM's headers and device library are found (setup.py), with relocatable device
// code linked against libnvshmem_device.a; it needs libnvshmem_host.so.3 at run time, the same library
// deepcomm._C opens with dlopen (one instance per process: the loader matches it by soname). It links neither
// libtorch nor libcuda. Raw pointers and streams as ints, like deepcomm._C; the launches take the typed arguments
// deepcomm._C.transport binds (HierDispatchLaunch, HierCombineLaunch: csrc/bindings/hier_launch.hpp), so
// deepcomm._C must be imported first (the transports are its).
#include <host/nvshmem_api.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <vector>
#include <string>

#include "../bindings/hier_launch.hpp"
#include "../transport/key_table.hpp"
#include "rail_round.hpp"

namespace py = pybind11;
using namespace dc;
using dc::bindings::HierCombineLaunch;
using dc::bindings::HierDispatchLaunch;

namespace {

bool g_device_state = false;

// Register this module's nvshmemi_device_state_d with the host library, which fills it (peer heap bases,
// transports) now and on every later change. NVSHMEM must already be initialized by deepcomm._C.nvshmem (the
// Buffer's session): the device archive's nvshmemi_init_thread then only adds this module (bootstrap flags 0,
// no collective), where a first call would start NVSHMEM's collective initialization.
void init_device_state() {
  if (g_device_state) return;
  const int status = nvshmemx_init_status();
  if (status < NVSHMEM_STATUS_IS_INITIALIZED)
    throw std::runtime_error("deepcomm._nvshmem_kernels: NVSHMEM is not initialized in this process (status " +
                             std::to_string(status) + "); allocate the transport's symmetric block first");
  int provided = 0;
  const nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                      NVSHMEM_VENDOR_PATCH_VERSION};
  if (nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, 0, nullptr, version) != 0)
    throw std::runtime_error("deepcomm._nvshmem_kernels: registering the device state with NVSHMEM failed");
  g_device_state = true;
}

void require_device_state(const char* what) {
  if (!g_device_state)
    throw std::runtime_error(std::string("deepcomm._nvshmem_kernels.") + what + ": call init_device_state() first");
}

// One exchange round of NvshmemTransport from the GPU: `peers`, `bytes` and `begins` per peer (equal lengths).
void rail_round(uintptr_t signal, uintptr_t credit, uintptr_t send, uintptr_t recv, int64_t slot_bytes, int rank,
                uint64_t round, uint64_t landed, const std::vector<int>& peers, const std::vector<uint64_t>& bytes,
                const std::vector<uint64_t>& begins, uintptr_t err_dev, double timeout_s, uintptr_t stream) {
  require_device_state("rail_round");
  if (peers.size() > size_t(kRailRoundMaxPeers) || bytes.size() != peers.size() || begins.size() != peers.size())
    throw std::invalid_argument("rail_round: peers, bytes and begins must have one entry per peer, at most " +
                                std::to_string(kRailRoundMaxPeers));
  RailRoundArgs a{};
  a.signal = reinterpret_cast<uint64_t*>(signal);
  a.credit = reinterpret_cast<uint64_t*>(credit);
  a.send = reinterpret_cast<const uint8_t*>(send);
  a.recv = reinterpret_cast<uint8_t*>(recv);
  a.slot_bytes = slot_bytes;
  a.rank = rank;
  a.num_peers = int(peers.size());
  a.round = round;
  a.landed = landed;
  for (size_t i = 0; i < peers.size(); ++i) {
    if (bytes[i] > uint64_t(slot_bytes))
      throw std::invalid_argument("rail_round: a block of " + std::to_string(bytes[i]) + " bytes exceeds the slot");
    a.peers[i] = RailRoundPeer{peers[i], 0, bytes[i], begins[i]};
  }
  const WaitCtx ctx{reinterpret_cast<ErrorRecord*>(err_dev), uint64_t(timeout_s * 1e9), rank, round, nullptr};
  launch_rail_round(a, ctx, reinterpret_cast<cudaStream_t>(stream));
}

}  // namespace

PYBIND11_MODULE(_nvshmem_kernels, m) {
  m.doc() = "deepcomm's hierarchical internode kernels over NVSHMEM device puts (raw pointers and streams)";
  m.attr("NVSHMEM_VERSION") = std::to_string(NVSHMEM_VENDOR_MAJOR_VERSION) + "." +
                              std::to_string(NVSHMEM_VENDOR_MINOR_VERSION) + "." +
                              std::to_string(NVSHMEM_VENDOR_PATCH_VERSION);
  m.attr("NVSHMEM_CHUNKS") = kNvshmemChunks;
  m.def("init_device_state", &init_device_state,
        "Register this module's NVSHMEM device state (NVSHMEM must be initialized); idempotent.");
  m.def("device_state_ready", [] { return g_device_state; });
  m.attr("RAIL_ROUND_MAX_PEERS") = kRailRoundMaxPeers;
  m.def("rail_round", &rail_round, py::arg("signal"), py::arg("credit"), py::arg("send"), py::arg("recv"),
        py::arg("slot_bytes"), py::arg("rank"), py::arg("round"), py::arg("landed"), py::arg("peers"),
        py::arg("bytes"), py::arg("begins"), py::arg("err_dev"), py::arg("timeout_s"), py::arg("stream"),
        "Launch one exchange round of the NVSHMEM transport (credits, bounded credit waits, put-with-signal, "
        "quiet) on `stream`; the caller waits for the peers' signals.");
  m.def("hier_dispatch", [](const HierDispatchLaunch& l, uintptr_t stream) {
    require_device_state("hier_dispatch");
    launch_hier_dispatch(l.args(), transport::KeyTable{}, l.common.wait_ctx(), reinterpret_cast<cudaStream_t>(stream));
  }, py::arg("launch"), py::arg("stream"), "Launch one hierarchical dispatch whose RDMA hop is NVSHMEM device puts.");
  m.def("hier_combine", [](const HierCombineLaunch& l, uintptr_t stream) {
    require_device_state("hier_combine");
    launch_hier_combine(l.args(), transport::KeyTable{}, l.common.wait_ctx(), reinterpret_cast<cudaStream_t>(stream));
  }, py::arg("launch"), py::arg("stream"), "Launch one hierarchical combine whose RDMA hop is NVSHMEM device puts.");
}
