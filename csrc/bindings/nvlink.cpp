// deepcomm._C normal mode over NVLink: NvlContext (the layout kernel; notify, dispatch, combine in one crossing
// each; csrc/runtime/nvl_calls.hpp). Argument order is positional: deepcomm/nvlink/backend.py is the caller.
// dispatch_call, dispatch_into and combine_call stay positional, not typed argument structs (typed_args.hpp): they
// are on the host-time-critical path, and every attribute Python sets on a struct costs host time per call.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

#include "../kernels/api.hpp"
#include "../runtime/cuda_check.hpp"
#include "../runtime/error_record.cuh"
#include "../runtime/nvl_calls.hpp"
#include "../runtime/nvl_context.hpp"
#include "../runtime/nvl_layout.hpp"
#include "../runtime/tuning.hpp"
#include "arena_views.hpp"
#include "args.hpp"
#include "fast_method.hpp"
#include "layout_dict.hpp"
#include "registry.hpp"

namespace py = pybind11;

namespace dc::bindings {

namespace {

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

// The knobs set_tuning / get_tuning name (runtime/tuning.hpp), by their environment variable's name.
TuningKnob tuning_knob(const std::string& name) {
  if (name == "DEEPCOMM_DISPATCH_UNROLL") return kTuneDispatchUnroll;
  if (name == "DEEPCOMM_DISPATCH_PREFETCH") return kTuneDispatchPrefetch;
  if (name == "DEEPCOMM_COMBINE_CONFIG") return kTuneCombineConfig;
  if (name == "DEEPCOMM_DISPATCH_FUSED") return kTuneDispatchFused;
  throw py::value_error("knob: not a tuning knob: " + name);
}

// One dispatch crossing's steps and arguments from the positional arguments of dispatch_call / dispatch_into.
NvlDispatchCall dispatch_call_of(const NvlContext& c, int flags, uintptr_t topk_idx, int T, int K, int E,
                                 uintptr_t in_rank, uintptr_t send_pos, uintptr_t notify_out, uint64_t host_tag,
                                 uintptr_t x, int64_t x_row_bytes, uintptr_t scales, int64_t scale_row_bytes,
                                 uintptr_t topk_weights, uintptr_t count_matrix, uintptr_t invalid_count,
                                 int64_t out_block, int64_t out_rows, int num_blocks, int expert_alignment,
                                 uintptr_t src_idx_copy, double wait_timeout_s, const Words& fingerprint) {
  NvlDispatchCall call;
  call.begin = flags & kCallBegin; call.notify = flags & kCallNotify; call.bump = flags & kCallBump;
  call.payload = flags & kCallPayload; call.wait = flags & kCallWait; call.finish = flags & kCallFinish;
  call.notify_args = NotifyArgs{ptr<const int64_t>(topk_idx), T, K, E, ptr<bool>(in_rank), ptr<int>(send_pos),
                                ptr<int>(notify_out), (flags & kCallWait) ? c.counts_device : nullptr, host_tag};
  call.notify_args.trace = c.notify_trace;
  const int R = c.layout.num_ranks;
  call.dispatch = DispatchArgs{ptr<const void>(x), ptr<const void>(scales), ptr<const int64_t>(topk_idx),
                               ptr<const float>(topk_weights), ptr<int>(send_pos), ptr<int>(count_matrix),
                               ptr<const int>(invalid_count), (flags & kCallReportInvalid) != 0, T, K, E / R,
                               x_row_bytes, scale_row_bytes, out_block, out_rows, ptr<int>(src_idx_copy)};
  // the words travel with the call's first exchange: notify's counts, or a cached dispatch's mailbox
  if (call.notify) call.notify_args.agree = fingerprint_of(fingerprint);
  else if (call.bump) call.dispatch.agree = fingerprint_of(fingerprint);
  call.num_blocks = num_blocks;
  call.expert_alignment = expert_alignment;
  call.wait_timeout_s = wait_timeout_s;
  return call;
}

NvlDispatchResult run_dispatch(const NvlContext& c, const StreamOrder& order, const NvlDispatchCall& call) {
  py::gil_scoped_release release;  // the wait for the counts must not hold other Python threads
  return nvl_dispatch(c, order, call);
}

// (status, num_recv, bad_all, bad_mine, aligned rows per local expert, `out`, microseconds waited for the counts)
py::tuple dispatch_result(const NvlDispatchResult& r, py::object out) {
  return py::make_tuple(r.status, r.num_recv, r.bad_all, r.bad_mine, r.per_expert, std::move(out), r.waited_us);
}

// NvlContext.dispatch_into(arena, arena_at, reserve_rows, x_type, scale_type, with_idx, with_weights, flags, caller,
// comm, previous, start, end, topk_idx, T, K, E, in_rank, send_pos, notify_out, host_tag, x, x_row_bytes, scales,
// scale_row_bytes, topk_weights, count_matrix, invalid_count, out_rows, num_blocks, expert_alignment, src_idx_copy,
// wait_timeout_s, fingerprint): dispatch_call into a block of `arena` (an ArenaCore over this buffer's arena region,
// which starts `arena_at` bytes into the buffer) reserved for `reserve_rows` rows, with the outputs' views made in the
// same crossing: None when the arena has no such block (nothing launched), else dispatch_call's tuple with the views
// (x, scales, topk_idx, topk_weights; None where not returned) in place of the offsets, or None where the counts came
// back bad (status 2 / 3: the block is given back; status 1 keeps it, the buffer is broken). A waited call keeps
// only the block's first bytes for the rows that came. x_type / scale_type: the outputs' packed DLPack types
// (runtime/dispatch_views.hpp); with_idx / with_weights: whether topk_idx / topk_weights come back (said, not read
// from the pointers: an empty tensor's pointer may be null). Every fresh and cached dispatch makes this crossing, so
// its arguments are read with the C API (fast_method.hpp).
PyObject* dispatch_into(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return fast_method_body("NvlContext.dispatch_into", nargs, 34, [&](FastArgs& a) -> py::object {
    const NvlContext& c = py::handle(self).cast<const NvlContext&>();
    BoundArena& arena = a.object<BoundArena>();
    const int64_t arena_at = a.i64(), reserve_rows = a.i64();
    const int x_type = a.i32(), scale_type = a.i32();
    const bool with_idx = a.boolean(), with_weights = a.boolean();
    const int flags = a.i32();
    const uintptr_t caller = a.u64(), comm = a.u64(), previous = a.u64(), start = a.u64(), end = a.u64();
    const uintptr_t topk_idx = a.u64();
    const int T = a.i32(), K = a.i32(), E = a.i32();
    const uintptr_t in_rank = a.u64(), send_pos = a.u64(), notify_out = a.u64();
    const uint64_t host_tag = a.u64();
    const uintptr_t x = a.u64();
    const int64_t x_row_bytes = a.i64();
    const uintptr_t scales = a.u64();
    const int64_t scale_row_bytes = a.i64();
    const uintptr_t topk_weights = a.u64(), count_matrix = a.u64(), invalid_count = a.u64();
    const int64_t out_rows = a.i64();
    const int num_blocks = a.i32(), expert_alignment = a.i32();
    const uintptr_t src_idx_copy = a.u64();
    const double wait_timeout_s = a.f64();
    const Words fingerprint = a.ints<kFingerprintWords>();
    host_stamp(c.host_stamps, kStampEntry);
    const DispatchOutputs outputs{x_type, x_row_bytes, scale_type, scale_row_bytes, K, with_idx, with_weights};
    auto got = into_block(arena, DispatchOutLayout(reserve_rows, x_row_bytes, scale_row_bytes, K).total,
                          (flags & kCallWait) != 0, outputs, [&](int64_t offset) {
      const NvlDispatchCall call = dispatch_call_of(
          c, flags, topk_idx, T, K, E, in_rank, send_pos, notify_out, host_tag, x, x_row_bytes, scales,
          scale_row_bytes, topk_weights, count_matrix, invalid_count, arena_at + offset, out_rows, num_blocks,
          expert_alignment, src_idx_copy, wait_timeout_s, fingerprint);
      return run_dispatch(c, stream_order(caller, comm, previous, start, end, flags), call);
    });
    if (!got) return py::none();
    host_stamp(c.host_stamps, kStampViews);
    py::tuple result = dispatch_result(got->result, got->views);
    host_stamp(c.host_stamps, kStampResult);
    return std::move(result);
  }, args);
}

PyMethodDef dispatch_into_def = {"dispatch_into",
                                 reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&dispatch_into)),
                                 METH_FASTCALL, "NvlContext.dispatch_into (csrc/bindings/nvlink.cpp)"};

// NvlContext.combine_call(flags, caller, comm, previous, start, end, num_blocks, x, topk_weights, recv_src_idx,
// count_matrix, send_pos, out, out_weights, N, T, H, K, use_fp8, fingerprint): one normal combine in the stream
// order of `flags` (kCallWaitCaller / kCallCallerWaits). Every combine makes this crossing, so its arguments are
// read with the C API (fast_method.hpp).
PyObject* combine_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  return fast_method_body("NvlContext.combine_call", nargs, 20, [&](FastArgs& a) -> py::object {
    const NvlContext& c = py::handle(self).cast<const NvlContext&>();
    const int flags = a.i32();
    const uintptr_t caller = a.u64(), comm = a.u64(), previous = a.u64(), start = a.u64(), end = a.u64();
    const int num_blocks = a.i32();
    const uintptr_t x = a.u64(), topk_weights = a.u64(), recv_src_idx = a.u64(), count_matrix = a.u64();
    const uintptr_t send_pos = a.u64(), out = a.u64(), out_weights = a.u64();
    const int N = a.i32(), T = a.i32(), H = a.i32(), K = a.i32();
    const bool use_fp8 = a.boolean();
    const Words fingerprint = a.ints<kFingerprintWords>();
    CombineArgs args{ptr<const void>(x), ptr<const float>(topk_weights), ptr<const int>(recv_src_idx),
                     ptr<const int>(count_matrix), ptr<const int>(send_pos), ptr<void>(out), ptr<float>(out_weights),
                     N, T, H, K, use_fp8, fingerprint_of(fingerprint)};
    nvl_combine(c, stream_order(caller, comm, previous, start, end, flags), args, num_blocks);
    return py::none();
  }, args);
}

PyMethodDef combine_call_def = {"combine_call",
                                reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&combine_call)),
                                METH_FASTCALL, "NvlContext.combine_call (csrc/bindings/nvlink.cpp)"};

}  // namespace

void register_nvlink(py::module_& m) {
  // Tuning knobs for measurement runs (runtime/tuning.hpp): the variant the following normal-mode launches pick, by
  // the name of the environment variable that sets it at start; a value a launch does not know raises there.
  m.def("set_tuning", [](const std::string& knob, int value) { set_tuning(tuning_knob(knob), value); },
        py::arg("knob"), py::arg("value"));
  m.def("get_tuning", [](const std::string& knob) { return tuning(tuning_knob(knob)); }, py::arg("knob"));
  // ---- NVLink context and collective kernels ----
  py::class_<NvlContext> nvl(m, "NvlContext");
  nvl.def(py::init<int, int, int, int, int64_t, int64_t, int64_t>(), py::arg("rank"), py::arg("num_ranks"),
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
      // diagnostics: device int64 [NOTIFY_TRACE_BLOCKS][NOTIFY_TRACE_POINTS][2] the notify kernels stamp (0: none)
      .def("set_notify_trace", [](NvlContext& c, uintptr_t dev) { c.notify_trace = ptr<uint64_t>(dev); })
      // diagnostics: host int64 [len(HOST_STAMP_NAMES)] a dispatch crossing stamps (runtime/host_stamps.hpp; 0: none)
      .def("set_host_stamps", [](NvlContext& c, uintptr_t host) { c.host_stamps = ptr<int64_t>(host); })
      // where low-latency calls leave their words in our memory (the low-latency buffer's agree slots, 4 sets of
      // [R]; 0: none): normal-mode waits look there too (WaitCtx::cross)
      .def("set_cross_slots", [](NvlContext& c, uintptr_t at, int sets) {
        DC_HOST_ASSERT(sets >= 0 && sets <= 4, "set_cross_slots: sets must be 0..4");
        c.cross = at != 0 ? ptr<const uint8_t>(at) : nullptr;
        c.cross_sets = at != 0 ? sets : 0;
      })
      // A call this rank rejected: take part in its first exchange with `fingerprint` (REJECTED set), in the
      // stream order of dispatch_call's flags (kCallWaitCaller), and move nothing (kernels/agree_reject.cu).
      // `compare`: also compare every peer's words with ours (a difference goes to the error record).
      .def("agree_reject", [](const NvlContext& c, const Words& fingerprint, int flags, uintptr_t caller,
                              uintptr_t comm, uintptr_t previous, uintptr_t start, bool compare) {
        const StreamOrder order = stream_order(caller, comm, previous, start, 0, flags);
        order.begin();
        launch_agree_reject(fingerprint_of(fingerprint), c.layout, c.peers, c.wait_ctx(), order.comm, compare);
      }, py::arg("fingerprint"), py::arg("flags"), py::arg("caller"), py::arg("comm"), py::arg("previous"),
         py::arg("start"), py::arg("compare") = false)
      // get_dispatch_layout: local, on `stream`; bad expert ids go into this rank's error record (kernels/layout.cu)
      .def("dispatch_layout", [](const NvlContext& c, uintptr_t topk_idx, int T, int K, int E, uintptr_t per_rank,
                                 uintptr_t per_expert, uintptr_t in_rank, uintptr_t stream) {
        LayoutArgs a{ptr<const int64_t>(topk_idx), T, K, E, c.layout.num_ranks, ptr<int>(per_rank),
                     ptr<int>(per_expert), ptr<bool>(in_rank)};
        launch_dispatch_layout(a, c.wait_ctx(), stream_of(stream));
      })
      .def("set_dispatch_counts", [](NvlContext& c, uintptr_t host, uintptr_t dev) {
        c.counts_host = ptr<DispatchCounts>(host);
        c.counts_device = ptr<DispatchCounts>(dev);
      })
      // One normal dispatch crossing (csrc/runtime/nvl_calls.hpp): the steps in `flags`, then
      // (status, num_recv, bad_all, bad_mine, aligned rows per local expert, DispatchOutLayout offsets + total,
      // microseconds the host waited for the counts).
      // Argument order: stream order | notify | payload | the rest; deepcomm/nvlink/backend.py is its one caller.
      .def("dispatch_call", [](const NvlContext& c, int flags, uintptr_t caller, uintptr_t comm, uintptr_t previous,
                               uintptr_t start, uintptr_t end,
                               uintptr_t topk_idx, int T, int K, int E, uintptr_t in_rank, uintptr_t send_pos,
                               uintptr_t notify_out, uint64_t host_tag,
                               uintptr_t x, int64_t x_row_bytes, uintptr_t scales, int64_t scale_row_bytes,
                               uintptr_t topk_weights, uintptr_t count_matrix, uintptr_t invalid_count,
                               int64_t out_block, int64_t out_rows,
                               int num_blocks, int expert_alignment, uintptr_t src_idx_copy, double wait_timeout_s,
                               const Words& fingerprint) {
        const NvlDispatchCall call = dispatch_call_of(
            c, flags, topk_idx, T, K, E, in_rank, send_pos, notify_out, host_tag, x, x_row_bytes, scales,
            scale_row_bytes, topk_weights, count_matrix, invalid_count, out_block, out_rows, num_blocks,
            expert_alignment, src_idx_copy, wait_timeout_s, fingerprint);
        const NvlDispatchResult r = run_dispatch(c, stream_order(caller, comm, previous, start, end, flags), call);
        return dispatch_result(r, py::make_tuple(r.out[0], r.out[1], r.out[2], r.out[3], r.out[4], r.out[5]));
      });
  add_fast_method(nvl, &dispatch_into_def);  // their comments are at the functions, above
  add_fast_method(nvl, &combine_call_def);
}

}  // namespace dc::bindings
