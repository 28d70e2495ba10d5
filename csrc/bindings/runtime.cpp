// deepcomm._C runtime: device facts, device and host-mapped memory, IPC handles, the error and agreement records.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "../kernels/api.hpp"
#include "../runtime/agree_record.hpp"
#include "../runtime/cuda_check.hpp"
#include "../runtime/dispatch_counts.hpp"
#include "../runtime/error_record.cuh"
#include "../runtime/ipc.hpp"
#include "args.hpp"
#include "registry.hpp"

namespace py = pybind11;

namespace dc::bindings {

namespace {

py::list rows_of(const int32_t (*rows)[kFingerprintWords], int n) {
  py::list out;
  for (int s = 0; s < n; ++s) {
    py::list row;
    for (int i = 0; i < kFingerprintWords; ++i) row.append(rows[s][i]);
    out.append(row);
  }
  return out;
}

}  // namespace

void register_runtime(py::module_& m) {
  // ---- device facts ----
  m.def("device_count", [] { int n = 0; return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0; });
  m.def("sm_count", [](int dev) {
    int n = 0;
    DC_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  });
  m.def("can_access_peer", [](int dev, int peer) {
    int ok = 0;
    DC_CUDA_CHECK(cudaDeviceCanAccessPeer(&ok, dev, peer));
    return ok != 0;
  });

  // ---- memory ----
  m.def("ipc_alloc", [](int64_t bytes) {
    auto a = ipc_alloc(bytes);
    return py::make_tuple(a.ptr, py::bytes(a.ipc_handle));
  });
  m.def("ipc_open", [](py::bytes h) { return ipc_open(std::string(h)); });
  m.def("ipc_close", &ipc_close);
  m.def("device_free", &device_free);
  m.def("copy_bytes", [](uintptr_t dst, uintptr_t src, int64_t bytes, uintptr_t stream) {  // any mapped pointers
    DC_CUDA_CHECK(cudaMemcpyAsync(ptr<void>(dst), ptr<const void>(src), size_t(bytes), cudaMemcpyDefault,
                                  stream_of(stream)));
  });
  m.def("host_mapped_alloc", [](int64_t bytes) {
    uintptr_t dev = 0;
    uintptr_t host = host_mapped_alloc(bytes, &dev);
    return py::make_tuple(host, dev);
  });
  m.def("host_mapped_free", &host_mapped_free);
  m.def("error_record_bytes", [] { return sizeof(ErrorRecord); });
  m.def("read_error", [](uintptr_t host) {
    ErrorRecord r;
    std::memcpy(&r, reinterpret_cast<const void*>(host), sizeof(r));
    return py::make_tuple(r.flag, r.rank, r.peer, r.stage, r.seq, r.waited_ns);
  });
  m.def("clear_error", [](uintptr_t host) { std::memset(reinterpret_cast<void*>(host), 0, sizeof(ErrorRecord)); });
  // ---- call agreement (runtime/agree_record.hpp; deepcomm/cuda/agree_record.py reads these) ----
  m.def("agree_record_bytes", [] { return sizeof(AgreeRecord); });
  // (flag, peer, word, seq, rows): rows[s] = rank s's words, for the record's num_ranks ranks
  m.def("read_agree", [](uintptr_t host) {
    const auto* r = ptr<const AgreeRecord>(host);
    const int flag = __atomic_load_n(&r->flag, __ATOMIC_ACQUIRE);
    const int n = flag == 1 ? std::min(std::max(r->num_ranks, 0), kAgreeRecordRanks) : 0;
    return py::make_tuple(flag, r->peer, r->word, r->seq, rows_of(r->rows, n));
  });
  m.def("clear_agree", [](uintptr_t host) { std::memset(reinterpret_cast<void*>(host), 0, sizeof(AgreeRecord)); });
  // A fresh dispatch whose wait returned status 3: (1 + first differing peer, its first differing word, rows)
  m.def("read_dispatch_disagreement", [](uintptr_t counts_host, int num_ranks) {
    const auto* h = ptr<const DispatchCounts>(counts_host);
    return py::make_tuple(count_value(h->disagree), count_value(h->disagree_word),
                          rows_of(h->agree_rows, std::min(num_ranks, kAgreeRecordRanks)));
  });
}

}  // namespace dc::bindings
