// deepcomm._selftest: the test-only module (tests/ and dev/ call it; nothing in deepcomm/ does). The ptx/ host twins
// and GPU self-test, the device queue pair checks, the CPU-thread runs of the device poster, NIC and internode round
// protocols, and the copy probes dev/profile_copy.py times. Raw pointers (int) and streams (int), like deepcomm._C;
// it takes deepcomm._C.transport.KeyTable, so it imports deepcomm._C first (pybind11 shares the registered type
// between the two modules).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "../../ptx/bswap.cuh"
#include "../runtime/cuda_check.hpp"
#include "../runtime/hier_rows.hpp"
#include "../transport/device_qp_checked.hpp"
#include "copy_probe.hpp"
#include "launch_probe.hpp"
#include "internode_host_selftest.hpp"
#include "ptx_selftest.hpp"
#include "qp_selftest.hpp"

namespace py = pybind11;
using namespace dc;
using namespace dc::transport;

namespace {

WaitCtx make_ctx(uintptr_t err_dev, uint64_t timeout_ns, int rank, uintptr_t seq_ptr) {
  WaitCtx c{};
  c.err = reinterpret_cast<ErrorRecord*>(err_dev);
  c.timeout_ns = timeout_ns;
  c.rank = rank;
  c.seq_ptr = reinterpret_cast<const uint64_t*>(seq_ptr);
  return c;
}

// ---- ptx/ helpers: host twins and the GPU self-test (tests/runtime/test_ptx_host.py, tests/runtime/test_ptx.py) ----
void register_ptx(py::module_& m) {
  m.def("bswap32_host", [](uint32_t v) { return ptx::bswap32_host(v); });
  m.def("bswap64_host", [](uint64_t v) { return ptx::bswap64_host(v); });
  m.def("ptx_selftest", [](std::vector<uint64_t> values) {
    DC_HOST_ASSERT(values.size() == size_t(kSelftestValues), "ptx_selftest: needs 32 values");
    PtxSelftest r = run_ptx_selftest(values.data());
    py::dict d;
    d["bswap32"] = std::vector<uint32_t>(r.bswap32, r.bswap32 + kSelftestValues);
    d["bswap64"] = std::vector<uint64_t>(r.bswap64, r.bswap64 + kSelftestValues);
    d["acquire_sys"] = r.acquire_sys; d["acquire_gpu"] = r.acquire_gpu; d["relaxed_sys"] = r.relaxed_sys;
    d["na_u64"] = r.na_u64; d["acquire_sys_u32"] = r.acquire_sys_u32; d["volatile_s32"] = r.volatile_s32;
    d["add_sys"] = r.add_sys; d["add_gpu"] = r.add_gpu; d["add_gpu_u32"] = r.add_gpu_u32;
    d["cas_old_first"] = r.cas_old_first; d["cas_old_second"] = r.cas_old_second; d["cas_final"] = r.cas_final;
    d["lanemask_lt"] = std::vector<uint32_t>(r.lanemask_lt, r.lanemask_lt + 32);
    d["named_barrier_seen"] = r.named_barrier_seen; d["copy_mismatches"] = r.copy_match;
    d["timer_advanced"] = r.timer_advanced; d["threads"] = kSelftestThreads;
    return d;
  });
}

// ---- the device queue pair: GPU posting and the device NIC (tests/runtime/test_device_qp.py), and the same traffic
// on CPU threads (tests/runtime/test_qp_poster_host.py) ----
void register_device_qp(py::module_& m) {
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
     "Launch the device-QP traffic kernel (posters, device NIC, receive checkers); see csrc/selftest/qp_selftest.hpp.");

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

// ---- the internode exchange round on CPU threads (tests/internode/test_internode_host.py) ----
void register_internode(py::module_& m) {
  m.def("internode_test_byte", &internode_test_byte, py::arg("rank"), py::arg("round"), py::arg("offset"));
  m.def("internode_rounds_on_host", [](const std::vector<std::vector<uint64_t>>& sizes, uint32_t chunk_bytes,
                                       uint32_t log_wqebbs, double timeout_s) {
    if (log_wqebbs < 2 || log_wqebbs > kMaxLogWqebbs) throw std::invalid_argument("log_wqebbs must be in [2, 15]");
    InternodeHostRun r;
    {
      py::gil_scoped_release nogil;
      r = run_internode_rounds_on_host(sizes, chunk_bytes, log_wqebbs, timeout_s);
    }
    py::list ranks;
    for (const InternodeHostRank& k : r.rank) {
      py::dict d;
      d["mismatched_rounds"] = k.mismatched_rounds; d["rounds_done"] = k.rounds_done; d["fa_old"] = k.fa_old;
      d["credit"] = k.credit; d["signal"] = k.signal;
      d["reserved"] = k.poster.reserved; d["published"] = k.poster.published; d["retired"] = k.poster.retired;
      d["cqes_seen"] = k.poster.cqes_seen; d["error_cqes"] = k.poster.error_cqes;
      d["nic_consumed"] = k.nic.consumed; d["nic_wqes"] = k.nic.wqes; d["nic_cqes"] = k.nic.cqes;
      d["nic_error"] = k.nic.error; d["nic_stopped"] = k.nic.stopped;
      ranks.append(d);
    }
    py::dict out;
    out["ranks"] = ranks;
    out["failed_stage"] = r.failed_stage;
    return out;
  }, py::arg("sizes"), py::arg("chunk_bytes"), py::arg("log_wqebbs"), py::arg("timeout_s"),
     "Synchronous: two ranks of CPU threads run internode exchange rounds "
     "(csrc/selftest/internode_host_selftest.hpp).");
}

}  // namespace

// ---- the hierarchical kernels' rows (csrc/runtime/hier_rows.hpp), built and split on the host by the word functions
// the kernels call (tests/internode/test_hier_rows_host.py); pointers are host addresses of CPU tensors ----
void register_hier_rows(py::module_& m) {
  m.def("hier_pack_rows_host", [](int64_t x_bytes, int64_t scale_bytes, int64_t topk, bool with_idx,
                                  bool with_weights, int gpus, uintptr_t x, uintptr_t scales, uintptr_t topk_idx,
                                  uintptr_t weights, uintptr_t masks, int64_t num_tokens, uintptr_t out) {
    const HierDispatchRow r(x_bytes, scale_bytes, topk, with_idx, with_weights, gpus);
    const HierRowSrc src{reinterpret_cast<const uint8_t*>(x), reinterpret_cast<const uint8_t*>(scales),
                         reinterpret_cast<const int64_t*>(topk_idx), reinterpret_cast<const float*>(weights)};
    const auto* mask = reinterpret_cast<const uint32_t*>(masks);
    for (int64_t t = 0; t < num_tokens; ++t)
      for (int64_t o = 0; o < r.stride; o += 4)
        store_word(reinterpret_cast<uint8_t*>(out), t * r.stride + o,
                   dispatch_row_word(r, src, t, o, mask != nullptr ? mask[t] : 0u));
    return r.stride;
  }, py::arg("x_bytes"), py::arg("scale_bytes"), py::arg("topk"), py::arg("with_idx"), py::arg("with_weights"),
     py::arg("gpus"), py::arg("x"), py::arg("scales"), py::arg("topk_idx"), py::arg("weights"), py::arg("masks"),
     py::arg("num_tokens"), py::arg("out"),
     "Build num_tokens dispatch rows (HierDispatchRow) into out [num_tokens][stride]; masks: uint32 [T] or 0.");
  m.def("hier_unpack_rows_host", [](int64_t x_bytes, int64_t scale_bytes, int64_t topk, bool with_idx,
                                    bool with_weights, int gpus, uintptr_t rows, int64_t n, uintptr_t out_x,
                                    uintptr_t out_scales, uintptr_t out_topk_idx, uintptr_t out_src_idx,
                                    uintptr_t out_weights, int64_t first_expert, int64_t local_experts) {
    const HierDispatchRow r(x_bytes, scale_bytes, topk, with_idx, with_weights, gpus);
    const HierRecvDst dst{reinterpret_cast<uint8_t*>(out_x), reinterpret_cast<uint8_t*>(out_scales),
                          reinterpret_cast<int64_t*>(out_topk_idx), reinterpret_cast<int32_t*>(out_src_idx),
                          reinterpret_cast<float*>(out_weights), first_expert, local_experts};
    const auto* at = reinterpret_cast<const uint8_t*>(rows);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t o = 0; o < r.stride; o += 4) dispatch_unpack_word(r, dst, i, o, load_word(at, i * r.stride + o));
      if (!dispatch_unpacks_slots(r, dst)) continue;
      for (int64_t k = 0; k < r.topk; ++k)  // the kernel gives each slot a lane
        dispatch_unpack_slot(r, dst, i, k, load_word(at, i * r.stride + r.idx_off + 8 * k),
                             load_word(at, i * r.stride + r.idx_off + 8 * k + 4),
                             r.w_off >= 0 ? load_word(at, i * r.stride + r.w_off + 4 * k) : 0u);
    }
  }, py::arg("x_bytes"), py::arg("scale_bytes"), py::arg("topk"), py::arg("with_idx"), py::arg("with_weights"),
     py::arg("gpus"), py::arg("rows"), py::arg("n"), py::arg("out_x"), py::arg("out_scales"), py::arg("out_topk_idx"),
     py::arg("out_src_idx"), py::arg("out_weights"), py::arg("first_expert") = 0, py::arg("local_experts") = 0,
     "Split n dispatch rows [n][stride] into the outputs (0: not wanted); local_experts > 0: local ids and masked "
     "weights (HierRecvDst).");
  m.def("hier_held_rows_host", [](int64_t hidden, int64_t topk, uintptr_t x, uintptr_t weights, int64_t n,
                                  uintptr_t out) {
    // bf16 held rows: x as is, then the tail words (the kernel's fp8 variant quantizes x with fp8_cast.cuh)
    const HierHeldRow h(hidden, topk, false);
    auto* o = reinterpret_cast<uint8_t*>(out);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t b = 0; b < h.x_bytes; b += 4)
        store_word(o, j * h.stride + b, load_word(reinterpret_cast<const uint8_t*>(x), j * h.x_bytes + b));
      for (int64_t b = h.x_bytes; b < h.stride; b += 4)
        store_word(o, j * h.stride + b, held_row_tail_word(h, reinterpret_cast<const float*>(weights), topk, j, b));
    }
    return h.stride;
  }, py::arg("hidden"), py::arg("topk"), py::arg("x"), py::arg("weights"), py::arg("n"), py::arg("out"),
     "Build n bf16 held rows (HierHeldRow) of x bf16 [n][hidden] and weights fp32 [n][topk] (or 0) into out.");
}

// ---- copy probes (dev/profile_copy.py; tests/runtime/test_copy_probe.py checks their bytes) ----
void register_copy_probe(py::module_& m) {
  m.def("copy_probe", [](const std::string& kind, uintptr_t src, uintptr_t dst, int64_t rows, int64_t row_bytes,
                         int blocks, uintptr_t stream, int threads, int unroll, bool l2_hint, int producers,
                         int slots, int chunk, bool lane0_waits) {
    CopyProbe p;
    p.src = reinterpret_cast<const void*>(src), p.dst = reinterpret_cast<void*>(dst);
    p.rows = rows, p.row_bytes = row_bytes, p.blocks = blocks;
    p.threads = threads, p.unroll = unroll, p.l2_hint = l2_hint;
    p.producers = producers, p.slots = slots, p.chunk = chunk, p.lane0_waits = lane0_waits;
    launch_copy_probe(kind.c_str(), p, reinterpret_cast<cudaStream_t>(stream));
  }, py::arg("kind"), py::arg("src"), py::arg("dst"), py::arg("rows"), py::arg("row_bytes"), py::arg("blocks"),
     py::arg("stream"), py::arg("threads") = 512, py::arg("unroll") = 8, py::arg("l2_hint") = false,
     py::arg("producers") = 1, py::arg("slots") = 4, py::arg("chunk") = 0, py::arg("lane0_waits") = false);
}

// ---- launch probes (dev/profile_host_parts.py) ----
void register_launch_probe(py::module_& m) {
  m.def("launch_probe", [](int batches, uintptr_t stream) {
    return launch_probe(batches, reinterpret_cast<cudaStream_t>(stream));
  }, py::arg("batches"), py::arg("stream"), "Median host ns per launch and stream-order operation.");
  // the host cost of a crossing's argument conversion alone: as many int arguments as NvlContext.dispatch_into
  m.def("noop_35_ints", [](int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t, int64_t, int64_t) { return 0; });
  m.def("noop_gil_release", [] {  // what a crossing's GIL release and re-acquire cost
    py::gil_scoped_release release;
    return 0;
  });
}

PYBIND11_MODULE(_selftest, m) {
  m.doc() = "deepcomm self-tests (test-only; raw pointers and streams; no libtorch)";
  py::module_::import("deepcomm._C");  // registers KeyTable, which qp_traffic takes
  register_ptx(m);
  register_device_qp(m);
  register_internode(m);
  register_hier_rows(m);
  register_copy_probe(m);
  register_launch_probe(m);
}
