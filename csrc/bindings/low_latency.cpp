// deepcomm._C low-latency mode: LlContext (its buffer layout, the send and receive halves of dispatch and combine).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../kernels/api.hpp"
#include "../runtime/cuda_check.hpp"
#include "../runtime/error_record.cuh"
#include "../runtime/ll_context.hpp"
#include "args.hpp"
#include "registry.hpp"

namespace py = pybind11;

namespace dc::bindings {

void register_low_latency(py::module_& m) {
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
        d["agree"] = l.agree;  // our agree slots [2 kinds][2 slots][R] (set_cross_slots of the NVLink context)
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
                           py::arg("agree_dispatch") = l.ib_agree_dispatch,
                           py::arg("weights") = l.ib_weights, py::arg("agree_combine") = l.ib_agree_combine,
                           py::arg("partials") = l.ib_partials,
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
        if (f == "agree_dispatch") return l.inbox_agree_at(kLlDispatch, slot, s);
        if (f == "agree_combine") return l.inbox_agree_at(kLlCombine, slot, s);
        if (f == "arrivals_dispatch") return l.arrival_at(kLlDispatch, slot, s, t);
        if (f == "arrivals_combine") return l.arrival_at(kLlCombine, slot, s, t);
        throw py::value_error("field_at: unknown field " + f);
      }, py::arg("field"), py::arg("slot"), py::arg("s"), py::arg("t") = 0)
      .def("set_peer", [](LlContext& c, int r, uintptr_t base) { c.set_peer(r, ptr<uint8_t>(base)); })
      // every rank's base as set_peer left it ([num_ranks]): what set_peer_table's device memory must hold
      .def("peer_bases", [](const LlContext& c) {
        return std::vector<uintptr_t>(reinterpret_cast<const uintptr_t*>(c.bases.data()),
                                      reinterpret_cast<const uintptr_t*>(c.bases.data()) + c.layout.num_ranks);
      })
      // device memory holding peer_bases() (int64 [num_ranks]), kept alive by the caller: the kernels read the
      // ranks past LL_INLINE_PEERS there
      .def("set_peer_table", [](LlContext& c, uintptr_t dev) { c.peers.all = ptr<uint8_t* const>(dev); })
      .def("set_error_record", [](LlContext& c, uintptr_t dev) { c.err_device = ptr<ErrorRecord>(dev); })
      .def("set_agree_record", [](LlContext& c, uintptr_t dev) { c.agree_device = ptr<AgreeRecord>(dev); })
      // where normal-mode calls leave their words in our memory (the NVLink buffer's agree slots, 2 sets of [R];
      // 0: none): low-latency waits look there too (WaitCtx::cross)
      .def("set_cross_slots", [](LlContext& c, uintptr_t at, int sets) {
        DC_HOST_ASSERT(sets >= 0 && sets <= 4, "set_cross_slots: sets must be 0..4");
        c.cross = at != 0 ? ptr<const uint8_t>(at) : nullptr;
        c.cross_sets = at != 0 ? sets : 0;
      })
      .def("set_timeout_ns", [](LlContext& c, uint64_t ns) { c.timeout_ns = ns; })
      // A call this rank rejected: a send half of `kind` (0 dispatch, 1 combine) into `slot` with only its words;
      // compare: also wait for the peers' words and record a difference (a call of a new shape, ll_calls.py);
      // blocks: the peers' block count (a buffer with put peers raises a rejected dispatch's arrival words)
      .def("agree_reject", [](const LlContext& c, const Words& fingerprint, int kind, int slot, uintptr_t stream,
                              bool compare, int blocks) {
        launch_ll_agree_reject(fingerprint_of(fingerprint), kind, slot, c.layout, c.launch_peers(), c.wait_ctx(),
                               stream_of(stream), compare, blocks);
      }, py::arg("fingerprint"), py::arg("kind"), py::arg("slot"), py::arg("stream"), py::arg("compare") = false,
         py::arg("blocks") = 0)
      // With put peers: after agree_reject (no compare) of the same words into the same kind and slot, and the
      // puts of them, wait for every live peer's words there and record a difference (a call of a new shape)
      .def("agree_compare", [](const LlContext& c, const Words& fingerprint, int kind, int slot, uintptr_t stream) {
        launch_ll_agree_compare(fingerprint_of(fingerprint), kind, slot, c.layout, c.launch_peers(), c.wait_ctx(),
                                stream_of(stream));
      }, py::arg("fingerprint"), py::arg("kind"), py::arg("slot"), py::arg("stream"))
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
        launch_ll_dispatch(a, phases, num_blocks, c.layout, c.launch_peers(), c.wait_ctx(), stream_of(stream));
      })
      .def("combine", [](const LlContext& c, int phases, int num_blocks, uintptr_t x, uintptr_t topk_weights,
                         uintptr_t topk_idx, uintptr_t out, int T, int K, int slot, bool use_fp8, uintptr_t stream,
                         const Words& fingerprint) {
        LlCombineArgs a{ptr<const void>(x), ptr<const float>(topk_weights), ptr<const int64_t>(topk_idx), ptr<void>(out),
                        T, K, slot, use_fp8, c.trace, c.pdl, fingerprint_of(fingerprint)};
        launch_ll_combine(a, phases, num_blocks, c.layout, c.launch_peers(), c.wait_ctx(), stream_of(stream));
      });
}

}  // namespace dc::bindings
