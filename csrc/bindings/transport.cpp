// deepcomm._C.transport. Addresses are ints, payloads are bytes; no torch types. Keys and QPNs are host order.
#include <pybind11/stl.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "../transport/cpu_proxy.hpp"
#include "../transport/host_qp.hpp"
#include "registry.hpp"

namespace py = pybind11;
using namespace dc::transport;

namespace {

// A ring of 2^log_wqebbs WQEBBs owned by Python-facing helpers (encode/decode without a queue pair).
struct ScratchRing {
  std::vector<uint64_t> words;  // 8-byte aligned backing
  SqRing sq;
  ScratchRing(uint32_t log_wqebbs, uint32_t qpn) : words((size_t(kWqebbBytes) << log_wqebbs) / 8, 0) {
    if (log_wqebbs > kMaxLogWqebbs) throw std::invalid_argument("log_wqebbs must be <= 15");
    sq = SqRing{reinterpret_cast<uint8_t*>(words.data()), log_wqebbs, qpn};
  }
  ScratchRing(const py::bytes& ring, uint32_t qpn) {
    const std::string s = ring;
    uint32_t log = 0;
    while ((size_t(kWqebbBytes) << log) < s.size()) ++log;
    if (s.empty() || (size_t(kWqebbBytes) << log) != s.size() || log > kMaxLogWqebbs)
      throw std::invalid_argument("ring: a power-of-two number of 64-byte WQEBBs");
    words.assign(s.size() / 8, 0);
    memcpy(words.data(), s.data(), s.size());
    sq = SqRing{reinterpret_cast<uint8_t*>(words.data()), log, qpn};
  }
  py::bytes bytes() const { return py::bytes(reinterpret_cast<const char*>(words.data()), words.size() * 8); }
};

WqeCtrl make_ctrl(uint8_t fm_ce_se, uint8_t signature, uint32_t imm) {
  WqeCtrl c;
  c.fm_ce_se = fm_ce_se;
  c.signature = signature;
  c.imm = imm;
  return c;
}

py::dict wqe_dict(const DecodedWqe& w, DecodeStatus status) {
  py::dict d;
  d["status"] = int(status);
  d["opcode"] = w.opcode; d["opmod"] = w.opmod; d["wqe_index"] = w.wqe_index; d["qpn"] = w.qpn; d["ds"] = w.ds;
  d["signature"] = w.signature; d["fm_ce_se"] = w.fm_ce_se; d["imm"] = w.imm;
  d["raddr"] = w.raddr; d["rkey"] = w.rkey; d["laddr"] = w.laddr; d["lkey"] = w.lkey; d["bytes"] = w.bytes;
  d["is_inline"] = w.is_inline; d["add"] = w.add; d["compare"] = w.compare; d["wqebbs"] = w.wqebbs();
  return d;
}

py::dict completion_dict(const Completion& c) {
  py::dict d;
  d["wqe_counter"] = c.wqe_counter; d["wqe_opcode"] = c.wqe_opcode; d["cqe_opcode"] = c.cqe_opcode;
  d["syndrome"] = c.syndrome; d["owner"] = c.owner; d["qpn"] = c.qpn; d["byte_count"] = c.byte_count;
  return d;
}

[[noreturn]] void raise_timeout(const std::string& msg) {
  PyErr_SetString(PyExc_TimeoutError, ("deepcomm: " + msg).c_str());
  throw py::error_already_set();
}

uint64_t seconds_to_ns(double s) {
  if (!(s >= 0)) throw std::invalid_argument("timeout must be >= 0 seconds");
  return uint64_t(s * 1e9);
}

// Single-threaded NIC over a queue pair: drain in the caller's thread, deterministically.
struct Nic {
  NicQueue queue;
  KeyTable keys;
};

}  // namespace

void dc::bindings::register_transport(py::module_& parent) {
  py::module_ m = parent.def_submodule("transport", "mlx5 WQE encoding, emulated NIC and CPU proxy (host side)");
  m.attr("WQEBB_BYTES") = kWqebbBytes;
  m.attr("CQE_BYTES") = kCqeBytes;
  m.attr("MAX_INLINE_BYTES") = kMaxInlineBytes;
  m.attr("OP_RDMA_WRITE") = int(kOpRdmaWrite);
  m.attr("OP_RDMA_WRITE_IMM") = int(kOpRdmaWriteImm);
  m.attr("OP_ATOMIC_FA") = int(kOpAtomicFetchAdd);
  m.attr("CTRL_CQ_UPDATE") = int(kCtrlCqUpdate);
  m.attr("CTRL_SOLICITED") = int(kCtrlSolicited);
  m.attr("CTRL_FENCE") = int(kCtrlFence);
  m.attr("CQE_REQ") = int(kCqeReq);
  m.attr("CQE_REQ_ERR") = int(kCqeReqErr);
  m.attr("CQE_INVALID") = int(kCqeInvalid);
  m.attr("SYNDROME_LOCAL_QP_OP") = int(kSyndromeLocalQpOp);
  m.attr("SYNDROME_LOCAL_PROT") = int(kSyndromeLocalProt);
  m.attr("SYNDROME_WR_FLUSH") = int(kSyndromeWrFlush);
  m.attr("SYNDROME_REMOTE_INV_REQ") = int(kSyndromeRemoteInvReq);
  m.attr("SYNDROME_REMOTE_ACCESS") = int(kSyndromeRemoteAccess);
  m.attr("DRAIN_CAUGHT_UP") = int(kDrainCaughtUp);
  m.attr("DRAIN_CQ_FULL") = int(kDrainCqFull);
  m.attr("DRAIN_BUDGET") = int(kDrainBudget);

  // ---- encoder / decoder on a scratch ring (returned as bytes) ----
  m.def("encode_rdma_write", [](uint32_t log_wqebbs, uint32_t qpn, uint32_t wqe_index, uint64_t laddr, uint32_t lkey,
                                uint64_t raddr, uint32_t rkey, uint32_t bytes, uint8_t fm_ce_se, uint8_t signature,
                                uint32_t imm, bool with_imm) {
    ScratchRing r(log_wqebbs, qpn);
    encode_rdma_write(r.sq, wqe_index, RdmaWrite{laddr, lkey, raddr, rkey, bytes}, make_ctrl(fm_ce_se, signature, imm),
                      with_imm);
    return r.bytes();
  }, py::arg("log_wqebbs"), py::arg("qpn"), py::arg("wqe_index"), py::arg("laddr"), py::arg("lkey"), py::arg("raddr"),
     py::arg("rkey"), py::arg("bytes"), py::arg("fm_ce_se") = kCtrlCqUpdate, py::arg("signature") = 0,
     py::arg("imm") = 0, py::arg("with_imm") = false);
  m.def("encode_fetch_add", [](uint32_t log_wqebbs, uint32_t qpn, uint32_t wqe_index, uint64_t laddr, uint32_t lkey,
                               uint64_t raddr, uint32_t rkey, uint64_t add, uint8_t fm_ce_se, uint8_t signature) {
    ScratchRing r(log_wqebbs, qpn);
    encode_fetch_add(r.sq, wqe_index, FetchAdd{laddr, lkey, raddr, rkey, add}, make_ctrl(fm_ce_se, signature, 0));
    return r.bytes();
  }, py::arg("log_wqebbs"), py::arg("qpn"), py::arg("wqe_index"), py::arg("laddr"), py::arg("lkey"), py::arg("raddr"),
     py::arg("rkey"), py::arg("add"), py::arg("fm_ce_se") = kCtrlCqUpdate, py::arg("signature") = 0);
  m.def("encode_rdma_write_inline", [](uint32_t log_wqebbs, uint32_t qpn, uint32_t wqe_index, py::bytes payload,
                                       uint64_t raddr, uint32_t rkey, uint8_t fm_ce_se) {
    const std::string p = payload;
    if (p.size() > kMaxInlineBytes) throw std::invalid_argument("inline payload too large");
    ScratchRing r(log_wqebbs, qpn);
    if (wqebbs_of_ds(ds_inline_write(uint32_t(p.size()))) > r.sq.wqebbs())
      throw std::invalid_argument("inline WQE larger than the ring");
    encode_rdma_write_inline(r.sq, wqe_index, p.data(), uint32_t(p.size()), raddr, rkey, make_ctrl(fm_ce_se, 0, 0));
    return r.bytes();
  }, py::arg("log_wqebbs"), py::arg("qpn"), py::arg("wqe_index"), py::arg("payload"), py::arg("raddr"),
     py::arg("rkey"), py::arg("fm_ce_se") = kCtrlCqUpdate);
  m.def("decode_wqe", [](py::bytes ring, uint32_t wqe_index) {
    ScratchRing r(ring, 0);
    DecodedWqe w;
    const DecodeStatus s = decode_wqe(r.sq, wqe_index, &w);
    py::dict d = wqe_dict(w, s);
    if (s == kDecodeOk && w.is_inline) {
      std::string payload(w.bytes, '\0');
      copy_inline_payload(r.sq, wqe_index, reinterpret_cast<uint8_t*>(&payload[0]), w.bytes);
      d["payload"] = py::bytes(payload);
    }
    return d;
  }, py::arg("ring"), py::arg("wqe_index"));
  m.def("dbrec_value", &dbrec_value, py::arg("pi"));
  m.def("doorbell_value", &doorbell_value, py::arg("pi"), py::arg("qpn"));

  // ---- registrations ----
  py::class_<KeyTable>(m, "KeyTable")
      .def(py::init([] { KeyTable t{}; return t; }))
      .def("add", [](KeyTable& t, uint32_t key, uint64_t addr, uint64_t length, uintptr_t ptr) {
        if (t.count == kMaxRegions) throw std::invalid_argument("KeyTable: at most " + std::to_string(kMaxRegions) + " regions");
        t.regions[t.count++] = MemRegion{key, addr, length, reinterpret_cast<uint8_t*>(ptr)};
      }, py::arg("key"), py::arg("addr"), py::arg("length"), py::arg("ptr"),
         "Key `key` names [addr, addr + length); the NIC reaches it at host pointer `ptr`.")
      .def("translate", [](const KeyTable& t, uint32_t key, uint64_t addr, uint64_t bytes) {
        return reinterpret_cast<uintptr_t>(t.translate(key, addr, bytes));
      })
      .def_property_readonly("count", [](const KeyTable& t) { return t.count; });

  // ---- a host queue pair: the poster's side ----
  py::class_<HostQueuePair>(m, "QueuePair")
      .def(py::init<uint32_t, uint32_t, uint32_t>(), py::arg("log_wqebbs"), py::arg("log_cqes"), py::arg("qpn"))
      .def("post_write", [](HostQueuePair& q, uint64_t laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                            uint32_t bytes, bool signaled) {
        return q.post_write(RdmaWrite{laddr, lkey, raddr, rkey, bytes}, make_ctrl(signaled ? kCtrlCqUpdate : 0, 0, 0));
      }, py::arg("laddr"), py::arg("lkey"), py::arg("raddr"), py::arg("rkey"), py::arg("bytes"),
         py::arg("signaled") = true)
      .def("post_write_inline", [](HostQueuePair& q, py::bytes payload, uint64_t raddr, uint32_t rkey, bool signaled) {
        const std::string p = payload;
        return q.post_write_inline(p.data(), uint32_t(p.size()), raddr, rkey,
                                   make_ctrl(signaled ? kCtrlCqUpdate : 0, 0, 0));
      }, py::arg("payload"), py::arg("raddr"), py::arg("rkey"), py::arg("signaled") = true)
      .def("post_fetch_add", [](HostQueuePair& q, uint64_t laddr, uint32_t lkey, uint64_t raddr, uint32_t rkey,
                                uint64_t add, bool signaled) {
        return q.post_fetch_add(FetchAdd{laddr, lkey, raddr, rkey, add}, make_ctrl(signaled ? kCtrlCqUpdate : 0, 0, 0));
      }, py::arg("laddr"), py::arg("lkey"), py::arg("raddr"), py::arg("rkey"), py::arg("add"),
         py::arg("signaled") = true)
      .def("ring", &HostQueuePair::ring)
      .def("poll", [](HostQueuePair& q, uint32_t max) {
        py::list out;
        for (const Completion& c : q.poll(max)) out.append(completion_dict(c));
        return out;
      }, py::arg("max") = 1u << 20)
      .def_property_readonly("producer_index", &HostQueuePair::producer_index)
      .def_property_readonly("retired_index", &HostQueuePair::retired_index)
      .def_property_readonly("free_wqebbs", &HostQueuePair::free_wqebbs)
      .def_property_readonly("wqebbs", [](const HostQueuePair& q) { return q.sq().wqebbs(); })
      .def_property_readonly("qpn", [](const HostQueuePair& q) { return q.sq().qpn; })
      .def("dbrec_bytes", [](const HostQueuePair& q) {
        return py::bytes(reinterpret_cast<const char*>(q.dbrec()), 2 * sizeof(uint32_t));
      })
      .def("doorbell_register_bytes", [](const HostQueuePair& q) {
        const uint64_t v = q.doorbell_register();
        return py::bytes(reinterpret_cast<const char*>(&v), sizeof(v));
      })
      .def("sq_bytes", [](const HostQueuePair& q) {
        return py::bytes(reinterpret_cast<const char*>(q.sq().wqes), size_t(q.sq().wqebbs()) * kWqebbBytes);
      })
      .def("cqe_bytes", [](const HostQueuePair& q, uint32_t index) {
        return py::bytes(reinterpret_cast<const char*>(q.cq().cqe(index)), kCqeBytes);
      }, py::arg("index"));

  // ---- the emulated NIC, drained in the caller's thread ----
  py::class_<Nic>(m, "Nic")
      .def(py::init([](const HostQueuePair& q, const KeyTable& keys) { return Nic{q.nic_view(), keys}; }),
           py::arg("qp"), py::arg("keys"), py::keep_alive<1, 2>())
      .def("drain", [](Nic& n, uint32_t max_wqes) {
        const DrainResult r = nic_drain(n.queue, n.keys, max_wqes);
        return py::make_tuple(r.wqes, int(r.status));
      }, py::arg("max_wqes") = 1u << 20)
      .def_property_readonly("consumer_index", [](const Nic& n) { return n.queue.ci; })
      .def_property_readonly("error", [](const Nic& n) { return n.queue.error; });

  m.def("wait_doorbell", [](const HostQueuePair& q, uint32_t ci, double timeout_s) {
    const uint64_t timeout_ns = seconds_to_ns(timeout_s);
    WaitResult r;
    {
      py::gil_scoped_release nogil;
      r = wait_doorbell(q.dbrec(), ci, timeout_ns);
    }
    if (r == WaitResult::kTimeout)
      raise_timeout("doorbell record did not move past " + std::to_string(ci & 0xffffu) + " within " +
                    std::to_string(timeout_s) + " s");
  }, py::arg("qp"), py::arg("ci"), py::arg("timeout_s"),
     "Wait until the queue's doorbell record announces WQEBBs beyond consumer index ci; TimeoutError otherwise.");

  // ---- the CPU proxy ----
  py::class_<CpuProxy>(m, "CpuProxy")
      .def(py::init([](const HostQueuePair& q, const KeyTable& keys, double poll_slice_s, double stall_timeout_s) {
        ProxyOptions o;
        o.poll_slice_ns = seconds_to_ns(poll_slice_s);
        o.stall_timeout_ns = seconds_to_ns(stall_timeout_s);
        return std::make_unique<CpuProxy>(q.nic_view(), keys, o);
      }), py::arg("qp"), py::arg("keys"), py::arg("poll_slice_s") = 0.001, py::arg("stall_timeout_s") = 5.0,
         py::keep_alive<1, 2>())
      .def("start", &CpuProxy::start)
      .def("stop", &CpuProxy::stop, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("running", &CpuProxy::running)
      .def_property_readonly("consumed", &CpuProxy::consumed)
      .def_property_readonly("wqes_executed", &CpuProxy::wqes_executed)
      .def_property_readonly("queue_error", &CpuProxy::queue_error)
      .def_property_readonly("failure", &CpuProxy::failure)
      .def("wait_consumed", [](const CpuProxy& p, uint32_t pi, double timeout_s) {
        const uint64_t timeout_ns = seconds_to_ns(timeout_s);
        std::string why;
        WaitResult r;
        {
          py::gil_scoped_release nogil;
          r = p.wait_consumed(pi, timeout_ns, &why);
        }
        if (r == WaitResult::kTimeout) raise_timeout(why);
        if (r == WaitResult::kStopped) throw std::runtime_error("deepcomm: " + why);
      }, py::arg("pi"), py::arg("timeout_s"),
         "Block until the proxy consumed every WQEBB before producer index pi; TimeoutError or RuntimeError if not.")
      .def("__enter__", [](CpuProxy& p) -> CpuProxy& { p.start(); return p; }, py::return_value_policy::reference)
      .def("__exit__", [](CpuProxy& p, py::args) { p.stop(); });

  register_device_qp(m);
  register_internode(m);
  register_hier(m);
}
