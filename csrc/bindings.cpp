// deepcomm._C: raw device pointers (int), sizes and cudaStream_t (int). No torch types cross this boundary.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "kernels/api.hpp"
#include "kernels/ll_phases.hpp"
#include "kernels/ll_trace_points.hpp"
#include "kernels/topk_max.hpp"
#include "runtime/cuda_check.hpp"
#include "runtime/error_record.cuh"
#include "runtime/ipc.hpp"
#include "runtime/ll_context.hpp"
#include "runtime/nvl_calls.hpp"
#include "runtime/nvl_context.hpp"
#include "runtime/nvl_layout.hpp"
#include "transport/bindings_nvshmem.hpp"
#include "transport/bindings_transport.hpp"

namespace py = pybind11;
using namespace dc;

namespace {

template <typename T>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }
cudaStream_t stream_of(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }
cudaEvent_t event_of(uintptr_t e) { return reinterpret_cast<cudaEvent_t>(e); }

// Flags of NvlContext.dispatch_call (deepcomm/cuda/nvl_calls.py names them; exported as DISPATCH_FLAGS).
enum DispatchFlag : int {
  kCallBegin = 1, kCallNotify = 2, kCallBump = 4, kCallPayload = 8, kCallWait = 16, kCallFinish = 32,
  kCallWaitCaller = 64, kCallCallerWaits = 128, kCallReportInvalid = 256,
};

StreamOrder stream_order(uintptr_t caller, uintptr_t comm, uintptr_t previous, uintptr_t start, uintptr_t end,
                         int flags) {
  StreamOrder o;
  o.caller = stream_of(caller);
  o.comm = stream_of(comm);
  o.previous = event_of(previous);
  o.start = event_of(start);
  o.end = event_of(end);
  o.wait_caller = (flags & kCallWaitCaller) != 0;
  o.caller_waits = (flags & kCallCallerWaits) != 0;
  return o;
}

// A call's words from Python (agreement.WORDS ints; all zeros: the call takes no part in agreement).
using Words = std::array<int32_t, kFingerprintWords>;
Fingerprint fingerprint_of(const Words& w) {
  Fingerprint f{};
  for (int i = 0; i < kFingerprintWords; ++i) f.w[i] = w[size_t(i)];
  return f;
}
py::list rows_of(const int32_t (*rows)[kFingerprintWords], int n) {
  py::list out;
  for (int s = 0; s < n; ++s) {
    py::list row;
    for (int i = 0; i < kFingerprintWords; ++i) row.append(rows[s][i]);
    out.append(row);
  }
  return out;
}

py::dict layout_dict(const NvlLayout& l) {
  py::dict d;
  d["seq_counter"] = l.seq_counter; d["notify_work"] = l.notify_work; d["notify_counts"] = l.notify_counts; d["notify_flag"] = l.notify_flag; d["mailbox"] = l.mailbox;
  d["dispatch_done"] = l.dispatch_done; d["combine_ready"] = l.combine_ready; d["combine_flag"] = l.combine_flag;
  d["combine_stage"] = l.combine_stage; d["arena"] = l.arena; d["total"] = l.total; d["agree"] = l.agree;
  d["signal_bytes"] = l.signal_bytes();
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  bind_transport(m);
  bind_nvshmem(m);
  m.doc() = "deepcomm CUDA core (raw pointers and streams; no libtorch)";
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("MAX_BLOCKS") = kMaxBlocks;
  m.attr("DISPATCH_COUNTS_BYTES") = int64_t(sizeof(DispatchCounts));
  m.attr("COUNTS_MAX_EXPERTS") = kCountsMaxExperts;
  m.attr("TOPK_MAX") = kTopkMax;
  {  // enum WaitStage (runtime/error_record.cuh): the numbers the kernels write into the error record
    py::dict s;
    s["notify_counts"] = int(kStageNotifyCounts); s["dispatch_mailbox"] = int(kStageDispatchMailbox);
    s["dispatch_done"] = int(kStageDispatchDone); s["combine_ready"] = int(kStageCombineReady);
    s["combine_token"] = int(kStageCombineToken); s["barrier"] = int(kStageBarrier);
    s["ll_counts"] = int(kStageLlCounts); s["ll_dispatch_data"] = int(kStageLlDispatchData);
    s["ll_combine_data"] = int(kStageLlCombineData); s["ll_combine_weights"] = int(kStageLlCombineWeights);
    s["qp_room"] = int(kStageQpRoom); s["qp_turn"] = int(kStageQpTurn); s["qp_quiet"] = int(kStageQpQuiet);
    s["nic_doorbell"] = int(kStageNicDoorbell); s["qp_error_cqe"] = int(kStageQpErrorCqe);
    s["qp_signal"] = int(kStageQpSignal); s["internode_credit"] = int(kStageInternodeCredit);
    s["nvshmem_credit"] = int(kStageNvshmemCredit); s["nvshmem_signal"] = int(kStageNvshmemSignal);
    s["node_barrier"] = int(kStageNodeBarrier); s["hier_free"] = int(kStageHierFree);
    s["hier_arrive"] = int(kStageHierArrive); s["hier_local"] = int(kStageHierLocal);
    s["invalid_ids"] = int(kStageInvalidIds); s["overflow"] = int(kStageOverflow);
    s["ll_invalid_ids"] = int(kStageLlInvalidIds); s["ll_duplicate_ids"] = int(kStageLlDuplicateIds);
    s["agree"] = int(kStageAgree); s["disagree"] = int(kStageDisagree);
    m.attr("WAIT_STAGES") = s;
  }
  {  // enum LlPhases (kernels/ll_phases.hpp): which halves a low-latency launch runs
    py::dict p;
    p["send"] = int(kLlSendPhase); p["recv"] = int(kLlRecvPhase); p["both"] = int(kLlBothPhases);
    p["weights"] = int(kLlWeightsPhase);
    m.attr("LL_PHASES") = p;
  }
  m.attr("LL_TRACE_POINTS") = kLlTracePoints;  // int64 stamps per block in a low-latency trace
  {
    py::dict f;
    f["begin"] = int(kCallBegin); f["notify"] = int(kCallNotify); f["bump"] = int(kCallBump);
    f["payload"] = int(kCallPayload); f["wait"] = int(kCallWait); f["finish"] = int(kCallFinish);
    f["wait_caller"] = int(kCallWaitCaller); f["caller_waits"] = int(kCallCallerWaits);
    f["report_invalid"] = int(kCallReportInvalid);
    m.attr("DISPATCH_FLAGS") = f;
  }

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
  m.attr("FINGERPRINT_WORDS") = kFingerprintWords;
  m.def("agree_record_bytes", [] { return sizeof(AgreeRecord); });
  // (flag, peer, word, seq, rows): rows[s] = rank s's words, for the record's num_ranks ranks
  m.def("read_agree", [](uintptr_t host) {
    const auto* r = ptr<const AgreeRecord>(host);
    const int flag = __atomic_load_n(&r->flag, __ATOMIC_ACQUIRE);
    const int n = flag == 1 ? std::min(std::max(r->num_ranks, 0), kMaxRanks) : 0;
    return py::make_tuple(flag, r->peer, r->word, r->seq, rows_of(r->rows, n));
  });
  m.def("clear_agree", [](uintptr_t host) { std::memset(reinterpret_cast<void*>(host), 0, sizeof(AgreeRecord)); });
  // A fresh dispatch whose wait returned status 3: (1 + first differing peer, its first differing word, rows)
  m.def("read_dispatch_disagreement", [](uintptr_t counts_host, int num_ranks) {
    const auto* h = ptr<const DispatchCounts>(counts_host);
    return py::make_tuple(h->disagree, h->disagree_word, rows_of(h->agree_rows, std::min(num_ranks, kMaxRanks)));
  });

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
  m.def("combine_row_bytes", &combine_row_bytes);
  m.def("combine_fp8_row_bytes", &combine_fp8_row_bytes);

  // ---- kernels without communication ----
  m.def("get_dispatch_layout", [](uintptr_t topk_idx, int T, int K, int E, int R, uintptr_t per_rank,
                                  uintptr_t per_expert, uintptr_t in_rank, uintptr_t send_pos, uintptr_t stream) {
    launch_dispatch_layout(ptr<const int64_t>(topk_idx), T, K, E, R, ptr<int>(per_rank), ptr<int>(per_expert),
                           ptr<bool>(in_rank), ptr<int>(send_pos), stream_of(stream));
  });

  // ---- NVLink context and collective kernels ----
  py::class_<NvlContext>(m, "NvlContext")
      .def(py::init<int, int, int, int, int64_t, int64_t, int64_t>(), py::arg("rank"), py::arg("num_ranks"),
           py::arg("local_experts_cap"), py::arg("max_tokens"), py::arg("hidden_max"), py::arg("topk_max"),
           py::arg("arena_bytes"))
      .def("layout", [](const NvlContext& c) { return layout_dict(c.layout); })
      .def("set_peer", [](NvlContext& c, int r, uintptr_t base) {
        DC_HOST_ASSERT(r >= 0 && r < c.layout.num_ranks, "set_peer: rank out of range");
        c.peers.base[r] = ptr<uint8_t>(base);
      })
      .def("set_error_record", [](NvlContext& c, uintptr_t dev) { c.err_device = ptr<ErrorRecord>(dev); })
      .def("set_timeout_ns", [](NvlContext& c, uint64_t ns) { c.timeout_ns = ns; })
      .def("set_error_host", [](NvlContext& c, uintptr_t host) { c.err_host = ptr<const ErrorRecord>(host); })
      .def("set_agree_record", [](NvlContext& c, uintptr_t dev) { c.agree_device = ptr<AgreeRecord>(dev); })
      // A call this rank rejected: take part in its first exchange with `fingerprint` (REJECTED set), in the
      // stream order of dispatch_call's flags (kCallWaitCaller), and move nothing (kernels/agree_reject.cu).
      .def("agree_reject", [](const NvlContext& c, const Words& fingerprint, int flags, uintptr_t caller,
                              uintptr_t comm, uintptr_t previous, uintptr_t start) {
        const StreamOrder order = stream_order(caller, comm, previous, start, 0, flags);
        order.begin();
        launch_agree_reject(fingerprint_of(fingerprint), c.layout, c.peers, c.wait_ctx(), order.comm);
      })
      .def("set_dispatch_counts", [](NvlContext& c, uintptr_t host, uintptr_t dev) {
        c.counts_host = ptr<const DispatchCounts>(host);
        c.counts_device = ptr<DispatchCounts>(dev);
      })
      // One normal dispatch crossing (csrc/runtime/nvl_calls.hpp): the steps in `flags`, then
      // (status, num_recv, bad_all, bad_mine, aligned rows per local expert, DispatchOutLayout offsets + total,
      // microseconds the host waited for the counts).
      // Argument order: stream order | notify | payload | the rest; deepcomm/cuda/nvl_calls.py is its one caller.
      .def("dispatch_call", [](const NvlContext& c, int flags, uintptr_t caller, uintptr_t comm, uintptr_t previous,
                               uintptr_t start, uintptr_t end,
                               uintptr_t topk_idx, int T, int K, int E, uintptr_t in_rank, uintptr_t send_pos,
                               uintptr_t notify_out, uint64_t host_tag,
                               uintptr_t x, int64_t x_row_bytes, uintptr_t scales, int64_t scale_row_bytes,
                               uintptr_t topk_weights, uintptr_t count_matrix, uintptr_t invalid_count,
                               int64_t out_block, int64_t out_rows,
                               int num_blocks, int expert_alignment, uintptr_t src_idx_copy, double wait_timeout_s,
                               const Words& fingerprint) {
        NvlDispatchCall call;
        call.begin = flags & kCallBegin; call.notify = flags & kCallNotify; call.bump = flags & kCallBump;
        call.payload = flags & kCallPayload; call.wait = flags & kCallWait; call.finish = flags & kCallFinish;
        call.notify_args = NotifyArgs{ptr<const int64_t>(topk_idx), T, K, E, ptr<bool>(in_rank), ptr<int>(send_pos),
                                      ptr<int>(notify_out), (flags & kCallWait) ? c.counts_device : nullptr,
                                      host_tag};
        const int R = c.layout.num_ranks;
        call.dispatch = DispatchArgs{ptr<const void>(x), ptr<const void>(scales),
                                     ptr<const int64_t>(topk_idx),
                                     ptr<const float>(topk_weights), ptr<int>(send_pos), ptr<int>(count_matrix),
                                     ptr<const int>(invalid_count), (flags & kCallReportInvalid) != 0, T, K, E / R,
                                     x_row_bytes, scale_row_bytes, out_block, out_rows, ptr<int>(src_idx_copy)};
        // the words travel with the call's first exchange: notify's counts, or a cached dispatch's mailbox
        if (call.notify) call.notify_args.agree = fingerprint_of(fingerprint);
        else if (call.bump) call.dispatch.agree = fingerprint_of(fingerprint);
        call.num_blocks = num_blocks;
        call.expert_alignment = expert_alignment;
        call.wait_timeout_s = wait_timeout_s;
        NvlDispatchResult r;
        {
          py::gil_scoped_release release;  // the wait for the counts must not hold other Python threads
          r = nvl_dispatch(c, stream_order(caller, comm, previous, start, end, flags), call);
        }
        return py::make_tuple(r.status, r.num_recv, r.bad_all, r.bad_mine, r.per_expert,
                              py::make_tuple(r.out[0], r.out[1], r.out[2], r.out[3], r.out[4], r.out[5]),
                              r.waited_us);
      })
      .def("combine_call", [](const NvlContext& c, int flags, uintptr_t caller, uintptr_t comm, uintptr_t previous,
                              uintptr_t start, uintptr_t end, int num_blocks, uintptr_t x, uintptr_t topk_weights,
                              uintptr_t recv_src_idx, uintptr_t count_matrix, uintptr_t send_pos, uintptr_t out,
                              uintptr_t out_weights, int N, int T, int H, int K, bool use_fp8,
                              const Words& fingerprint) {
        CombineArgs a{ptr<const void>(x), ptr<const float>(topk_weights), ptr<const int>(recv_src_idx),
                      ptr<const int>(count_matrix), ptr<const int>(send_pos), ptr<void>(out), ptr<float>(out_weights),
                      N, T, H, K, use_fp8, fingerprint_of(fingerprint)};
        nvl_combine(c, stream_order(caller, comm, previous, start, end, flags), a, num_blocks);
      });

  // ---- low-latency context and kernels ----
  py::class_<LlContext>(m, "LlContext")
      .def(py::init<int, int, int, int, int64_t, int, bool>(), py::arg("rank"), py::arg("num_ranks"),
           py::arg("num_experts"), py::arg("max_tokens"), py::arg("hidden"), py::arg("topk_max"),
           py::arg("outbox") = false)
      .def("layout", [](const LlContext& c) {
        const LlLayout& l = c.layout;
        py::dict d;
        d["total"] = l.total;
        d["mask"] = l.mask;
        d["signal_bytes"] = l.signal_bytes();
        d["inbox"] = l.inbox;
        d["outbox"] = l.outbox;
        d["block"] = l.block;
        d["entry"] = l.entry;
        // per kind (0 dispatch, 1 combine): the data and flags sections of a block, [begin, end) in the block
        d["data"] = py::make_tuple(py::make_tuple(l.data_begin(0), l.data_end(0)),
                                   py::make_tuple(l.data_begin(1), l.data_end(1)));
        d["flags"] = py::make_tuple(py::make_tuple(l.flags_begin(0), l.flags_end(0)),
                                    py::make_tuple(l.flags_begin(1), l.flags_end(1)));
        d["put_seq"] = l.ib_put_seq;
        d["ib"] = py::dict(py::arg("counts") = l.ib_counts, py::arg("ntok") = l.ib_ntok,
                           py::arg("meta") = l.ib_meta, py::arg("input_err") = l.ib_input_err,
                           py::arg("stage_x") = l.ib_stage_x, py::arg("stage_scales") = l.ib_stage_scales,
                           py::arg("weights") = l.ib_weights, py::arg("partials") = l.ib_partials,
                           py::arg("arrivals_dispatch") = l.ib_arrivals_dispatch,
                           py::arg("arrivals_combine") = l.ib_arrivals_combine);
        auto per_slot = [&](auto at) { return py::make_tuple(at(0), at(1)); };
        d["recv_x_slot"] = per_slot([&](int s) { return l.recv_x_at(s); });
        d["recv_scales_slot"] = per_slot([&](int s) { return l.recv_scales_at(s); });
        d["out_count_slot"] = per_slot([&](int s) { return l.out_count_at(s); });
        d["out_layout_slot"] = per_slot([&](int s) { return l.out_layout_at(s); });
        d["out_src_info_slot"] = per_slot([&](int s) { return l.out_src_info_at(s); });
        d["out_recv_pos_slot"] = per_slot([&](int s) { return l.out_recv_pos_at(s); });
        return d;
      })
      // The offset the kernels use for a field source rank s writes into us (the accessors of ll_layout.hpp), for
      // the host tests: t is the token, or the block of an arrival word, or which of the two bad-input words.
      .def("field_at", [](const LlContext& c, const std::string& f, int slot, int s, int t) -> int64_t {
        const LlLayout& l = c.layout;
        if (f == "counts") return l.counts_at(slot, s);
        if (f == "ntok") return l.ntok_at(slot, s);
        if (f == "meta") return l.meta_at(slot, s, t);
        if (f == "input_err") return l.input_err_at(slot, t, s);
        if (f == "stage_x") return l.stage_x_at(slot, s, t);
        if (f == "stage_scales") return l.stage_scales_at(slot, s, t);
        if (f == "weights") return l.weights_at(slot, s, t);
        if (f == "partials") return l.partials_at(slot, s, t);
        if (f == "arrivals_dispatch") return l.arrival_at(kLlDispatch, slot, s, t);
        if (f == "arrivals_combine") return l.arrival_at(kLlCombine, slot, s, t);
        throw py::value_error("field_at: unknown field " + f);
      }, py::arg("field"), py::arg("slot"), py::arg("s"), py::arg("t") = 0)
      .def("set_peer", [](LlContext& c, int r, uintptr_t base) {
        DC_HOST_ASSERT(r >= 0 && r < c.layout.num_ranks, "set_peer: rank out of range");
        c.peers.base[r] = ptr<uint8_t>(base);
      })
      .def("set_error_record", [](LlContext& c, uintptr_t dev) { c.err_device = ptr<ErrorRecord>(dev); })
      .def("set_agree_record", [](LlContext& c, uintptr_t dev) { c.agree_device = ptr<AgreeRecord>(dev); })
      .def("set_timeout_ns", [](LlContext& c, uint64_t ns) { c.timeout_ns = ns; })
      // A call this rank rejected: a send half of `kind` (0 dispatch, 1 combine) into `slot` with only its words
      .def("agree_reject", [](const LlContext& c, const Words& fingerprint, int kind, int slot, uintptr_t stream) {
        launch_ll_agree_reject(fingerprint_of(fingerprint), kind, slot, c.layout, c.peers, c.wait_ctx(),
                               stream_of(stream));
      })
      .def("set_trace", [](LlContext& c, uintptr_t dev) { c.trace = ptr<uint64_t>(dev); })
      .def("set_pdl", [](LlContext& c, int mode) {
        DC_HOST_ASSERT(mode >= 0 && mode <= 2, "set_pdl: mode must be 0, 1 or 2");
        c.pdl = mode;
      })
      // phases: 1 send half, 2 receive half, 3 both in one kernel, 4 (combine only) the weights alone
      // (LlPhases, csrc/kernels/ll_common.cuh)
      .def("dispatch", [](const LlContext& c, int phases, int num_blocks, uintptr_t x, uintptr_t topk_idx, int T,
                          int K, int slot, bool use_fp8, bool use_ue8m0, uintptr_t stream, const Words& fingerprint) {
        LlDispatchArgs a{ptr<const void>(x), ptr<const int64_t>(topk_idx), T, K, slot, use_fp8, use_ue8m0, c.trace,
                         c.pdl, fingerprint_of(fingerprint)};
        launch_ll_dispatch(a, phases, num_blocks, c.layout, c.peers, c.wait_ctx(), stream_of(stream));
      })
      .def("combine", [](const LlContext& c, int phases, int num_blocks, uintptr_t x, uintptr_t topk_weights,
                         uintptr_t topk_idx, uintptr_t out, int T, int K, int slot, bool use_fp8, uintptr_t stream,
                         const Words& fingerprint) {
        LlCombineArgs a{ptr<const void>(x), ptr<const float>(topk_weights), ptr<const int64_t>(topk_idx), ptr<void>(out),
                        T, K, slot, use_fp8, c.trace, c.pdl, fingerprint_of(fingerprint)};
        launch_ll_combine(a, phases, num_blocks, c.layout, c.peers, c.wait_ctx(), stream_of(stream));
      });
}
