// deepcomm._C.transport, device part: the layout of a device queue pair, its initialisation, and the GPU checks
// of device posting and the device emulated NIC. Pointers are ints; streams are ints.
#include <pybind11/stl.h>

#include <string>

#include "../kernels/qp_selftest.hpp"
#include "../runtime/cuda_check.hpp"
#include "bindings_transport.hpp"

namespace py = pybind11;
using namespace dc;
using namespace dc::transport;

namespace {

DeviceQpLayout checked_layout(uint32_t log_wqebbs, uint32_t log_cqes) {
  if (log_wqebbs < 2 || log_wqebbs > kMaxLogWqebbs) throw std::invalid_argument("log_wqebbs must be in [2, 15]");
  if (log_cqes > kMaxLogCqes) throw std::invalid_argument("log_cqes must be <= 16");
  return DeviceQpLayout::make(log_wqebbs, log_cqes);
}

WaitCtx make_ctx(uintptr_t err_dev, uint64_t timeout_ns, int rank, uintptr_t seq_ptr) {
  WaitCtx c{};
  c.err = reinterpret_cast<ErrorRecord*>(err_dev);
  c.timeout_ns = timeout_ns;
  c.rank = rank;
  c.seq_ptr = reinterpret_cast<const uint64_t*>(seq_ptr);
  return c;
}

}  // namespace

void bind_device_qp(py::module_& m) {
  m.def("device_qp_layout", [](uint32_t log_wqebbs, uint32_t log_cqes) {
    const DeviceQpLayout l = checked_layout(log_wqebbs, log_cqes);
    py::dict d;
    d["ring"] = l.ring; d["cqes"] = l.cqes; d["dbrec"] = l.dbrec; d["doorbell"] = l.doorbell;
    d["cq_dbrec"] = l.cq_dbrec; d["poster"] = l.poster; d["nic"] = l.nic; d["total"] = l.total;
    d["poster_fields"] = py::make_tuple("reserved", "published", "retired", "cq_ci", "lock", "cqes_seen",
                                        "error_cqes", "first_syndrome");
    d["nic_fields"] = py::make_tuple("consumed", "wqes", "cqes", "error", "stopped");
    return d;
  }, py::arg("log_wqebbs"), py::arg("log_cqes"),
     "Byte offsets of a device queue pair's parts (64-byte aligned) and the u32 fields of its poster/NIC records.");
  m.def("device_qp_init", [](uintptr_t base, uint32_t log_wqebbs, uint32_t log_cqes, uint32_t start, uintptr_t stream) {
    launch_device_qp_init(reinterpret_cast<uint8_t*>(base), checked_layout(log_wqebbs, log_cqes), start,
                          reinterpret_cast<cudaStream_t>(stream));
  }, py::arg("base"), py::arg("log_wqebbs"), py::arg("log_cqes"), py::arg("start"), py::arg("stream"));

  m.def("qp_test_message_bytes", &qp_test_message_bytes, py::arg("channel"), py::arg("message"),
        py::arg("slot_bytes"), py::arg("inline_every"));
  m.def("qp_test_is_inline", &qp_test_is_inline, py::arg("message"), py::arg("inline_every"));

  m.def("qp_encode_selftest", [](uintptr_t base, uint32_t log_wqebbs, uint32_t log_cqes, uint32_t qpn,
                                 const std::vector<py::dict>& specs, uintptr_t err_dev, double timeout_s,
                                 uintptr_t seq_ptr) {
    std::vector<QpTestWqe> v;
    for (const py::dict& d : specs) {
      QpTestWqe w{};
      const std::string kind = py::str(d["kind"]);
      if (kind == "write") w.kind = kQpTestWrite;
      else if (kind == "write_imm") w.kind = kQpTestWriteImm;
      else if (kind == "inline") w.kind = kQpTestInline;
      else if (kind == "fetch_add") w.kind = kQpTestFetchAdd;
      else throw std::invalid_argument("specs: kind must be write, write_imm, inline or fetch_add");
      auto get = [&](const char* k) { return d.contains(k) ? d[k].cast<uint64_t>() : uint64_t(0); };
      w.fm_ce_se = uint8_t(get("fm_ce_se")); w.signature = uint8_t(get("signature")); w.imm = uint32_t(get("imm"));
      w.laddr = get("laddr"); w.raddr = get("raddr"); w.add = get("add");
      w.lkey = uint32_t(get("lkey")); w.rkey = uint32_t(get("rkey")); w.bytes = uint32_t(get("bytes"));
      w.payload = reinterpret_cast<const uint8_t*>(get("payload"));
      if (w.kind == kQpTestInline && w.bytes > kMaxInlineBytes)
        throw std::invalid_argument("specs: inline bytes > 220");
      v.push_back(w);
    }
    py::gil_scoped_release nogil;
    return run_qp_encode_selftest(reinterpret_cast<uint8_t*>(base), checked_layout(log_wqebbs, log_cqes), qpn, v,
                                  make_ctx(err_dev, uint64_t(timeout_s * 1e9), 0, seq_ptr));
  }, py::arg("base"), py::arg("log_wqebbs"), py::arg("log_cqes"), py::arg("qpn"), py::arg("specs"),
     py::arg("err_dev"), py::arg("timeout_s"), py::arg("seq_ptr"),
     "Synchronous: thread i posts specs[i] (dicts: kind, fm_ce_se, signature, imm, laddr, lkey, raddr, rkey, bytes, "
     "add, payload) into the device queue pair; returns the WQE index of each.");

  m.def("qp_traffic", [](py::dict a, const KeyTable& keys, uintptr_t err_dev, double timeout_s, int rank,
                         uintptr_t seq_ptr, int peer, uintptr_t stream) {
    QpTrafficArgs t{};
    t.qp_base = reinterpret_cast<uint8_t*>(a["qp_base"].cast<uintptr_t>());
    t.layout = checked_layout(a["log_wqebbs"].cast<uint32_t>(), a["log_cqes"].cast<uint32_t>());
    t.qpn = a["qpn"].cast<uint32_t>();
    t.start = a["start"].cast<uint32_t>();
    t.channels = a["channels"].cast<int>();
    t.messages = a["messages"].cast<int>();
    t.slot_bytes = a["slot_bytes"].cast<int>();
    t.inline_every = a["inline_every"].cast<int>();
    t.lkey = a["lkey"].cast<uint32_t>();
    t.rkey = a["rkey"].cast<uint32_t>();
    t.local_src_addr = a["local_src_addr"].cast<uint64_t>();
    t.local_fa_old_addr = a["local_fa_old_addr"].cast<uint64_t>();
    t.remote_recv_addr = a["remote_recv_addr"].cast<uint64_t>();
    t.remote_counter_addr = a["remote_counter_addr"].cast<uint64_t>();
    t.peer_src = reinterpret_cast<const uint8_t*>(a["peer_src"].cast<uintptr_t>());
    t.recv = reinterpret_cast<uint8_t*>(a["recv"].cast<uintptr_t>());
    t.counters = reinterpret_cast<const uint64_t*>(a["counters"].cast<uintptr_t>());
    t.posters_done = reinterpret_cast<uint32_t*>(a["posters_done"].cast<uintptr_t>());
    t.nic_stop_target = a["nic_stop_target"].cast<uint32_t>();
    t.mismatches = reinterpret_cast<int*>(a["mismatches"].cast<uintptr_t>());
    if (t.messages < 0 || t.slot_bytes < 1) throw std::invalid_argument("messages >= 0 and slot_bytes >= 1");
    launch_qp_traffic(t, keys, make_ctx(err_dev, uint64_t(timeout_s * 1e9), rank, seq_ptr), peer,
                      reinterpret_cast<cudaStream_t>(stream));
  }, py::arg("args"), py::arg("keys"), py::arg("err_dev"), py::arg("timeout_s"), py::arg("rank"), py::arg("seq_ptr"),
     py::arg("peer"), py::arg("stream"),
     "Launch the device-QP traffic kernel (posters, device NIC, receive checkers); see csrc/kernels/qp_selftest.hpp.");

  m.def("qp_traffic_on_host", [](int channels, int messages, int slot_bytes, int inline_every, uint32_t log_wqebbs,
                                 uint32_t start, py::bytes src, double timeout_s, int nic_extra) {
    checked_layout(log_wqebbs, log_wqebbs);
    const std::string s = src;
    const std::vector<uint8_t> v(s.begin(), s.end());
    QpHostRun r;
    {
      py::gil_scoped_release nogil;
      r = run_qp_traffic_on_host(channels, messages, slot_bytes, inline_every, log_wqebbs, start, v, timeout_s,
                                 nic_extra);
    }
    py::dict d;
    d["recv"] = py::bytes(reinterpret_cast<const char*>(r.recv.data()), r.recv.size());
    d["counters"] = r.counters;
    d["fa_old"] = r.fa_old;
    d["reserved"] = r.poster.reserved; d["published"] = r.poster.published; d["retired"] = r.poster.retired;
    d["cqes_seen"] = r.poster.cqes_seen; d["error_cqes"] = r.poster.error_cqes;
    d["nic_consumed"] = r.nic.consumed; d["nic_wqes"] = r.nic.wqes; d["nic_cqes"] = r.nic.cqes;
    d["nic_error"] = r.nic.error; d["nic_stopped"] = r.nic.stopped;
    d["failed_stage"] = r.failed_stage; d["dbrec"] = r.dbrec;
    return d;
  }, py::arg("channels"), py::arg("messages"), py::arg("slot_bytes"), py::arg("inline_every"), py::arg("log_wqebbs"),
     py::arg("start"), py::arg("src"), py::arg("timeout_s"), py::arg("nic_extra") = 0,
     "The device-QP traffic with CPU threads as posters and as the NIC (the same qp_traffic_post and nic_serve).");
}
