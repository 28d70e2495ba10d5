// deepcomm._C constants: limits, and the numbers the kernels and the host agree on (wait stages, low-latency phases,
// dispatch_call flags), exported so that Python never copies them.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "../kernels/api.hpp"
#include "../kernels/ll_phases.hpp"
#include "../kernels/ll_trace_points.hpp"
#include "../kernels/notify_trace_points.hpp"
#include "../kernels/topk_max.hpp"
#include "../runtime/agree_record.hpp"
#include "../runtime/error_record.cuh"
#include "../runtime/host_stamps.hpp"
#include "../runtime/internode_layout.hpp"
#include "args.hpp"
#include "registry.hpp"

namespace py = pybind11;

namespace dc::bindings {

void register_constants(py::module_& m) {
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("LL_MAX_RANKS") = kLlMaxRanks;  // runtime/ll_layout.hpp
  m.attr("LL_INLINE_PEERS") = kLlInlinePeers;  // kernels/api.hpp: peers past these need LlContext.set_peer_table
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
    s["agree"] = int(kStageAgree); s["notify_local"] = int(kStageNotifyLocal); s["disagree"] = int(kStageDisagree);
    s["layout_invalid_ids"] = int(kStageLayoutInvalidIds);
    m.attr("WAIT_STAGES") = s;
  }
  {  // enum LlPhases (kernels/ll_phases.hpp): which halves a low-latency launch runs
    py::dict p;
    p["send"] = int(kLlSendPhase); p["recv"] = int(kLlRecvPhase); p["both"] = int(kLlBothPhases);
    p["weights"] = int(kLlWeightsPhase);
    m.attr("LL_PHASES") = p;
  }
  m.attr("LL_TRACE_POINTS") = kLlTracePoints;  // int64 stamps per block in a low-latency trace
  {  // the notify kernel's trace (kernels/notify_trace_points.hpp): [blocks][points][globaltimer ns, clock64]
    m.attr("NOTIFY_TRACE_POINTS") = kNotifyTracePoints;
    m.attr("NOTIFY_TRACE_BLOCKS") = kNotifyTraceBlocks;
    py::tuple names(kNotifyTracePoints);
    for (int p = 0; p < kNotifyTracePoints; ++p) names[p] = py::str(kNotifyTraceNames[p]);
    m.attr("NOTIFY_TRACE_NAMES") = names;
  }
  {  // a dispatch crossing's host stamps (runtime/host_stamps.hpp): [points] CLOCK_MONOTONIC ns
    py::tuple names(kHostStampPoints);
    for (int p = 0; p < kHostStampPoints; ++p) names[p] = py::str(kHostStampNames[p]);
    m.attr("HOST_STAMP_NAMES") = names;
  }
  {
    py::dict f;
    f["begin"] = int(kCallBegin); f["notify"] = int(kCallNotify); f["bump"] = int(kCallBump);
    f["payload"] = int(kCallPayload); f["wait"] = int(kCallWait); f["finish"] = int(kCallFinish);
    f["wait_caller"] = int(kCallWaitCaller); f["caller_waits"] = int(kCallCallerWaits);
    f["report_invalid"] = int(kCallReportInvalid);
    m.attr("DISPATCH_FLAGS") = f;
  }
  m.attr("FINGERPRINT_WORDS") = kFingerprintWords;
  m.attr("RAIL_HEADER_BYTES") = kRailHeaderBytes;  // runtime/internode_layout.hpp
  m.attr("MAX_NODE_HEADERS") = kMaxNodeHeaders;
}

}  // namespace dc::bindings
