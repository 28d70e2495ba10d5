// The numbered points a low-latency kernel stamps when tracing; kLlTracePoints is exported as LL_TRACE_POINTS.
#pragma once

namespace dc {

// Diagnostics (DEEPCOMM_LL_TRACE=1, dev/profile_low_latency.py): thread 0 of every block stamps the global
// timer at numbered points of a call into trace[block][point] (kLlTrace* below); nothing when trace is null.
constexpr int kLlTracePoints = 10;
enum LlTracePoint : int {
  kLlTraceEntry = 0,      // kernel entry
  kLlTraceSendData = 1,   // send: this block's rows stored
  kLlTraceSendMeta = 2,   // dispatch send: keys / counts stored, before the finish
  kLlTraceFinished = 3,   // send: fenced, and this block's arrival signalled to every rank
  kLlTraceWeights = 4,    // combine send: our weights published, expert row bases known
  kLlTraceArrived = 5,    // receive: every rank's arrival word reached
  kLlTraceRecvMeta = 6,   // dispatch receive: expert bases and token counts known
  kLlTraceEnd = 7,        // receive: this block's rows written
  kLlTraceCounts = 8,     // dispatch send, block 0: the counts histogram done
  kLlTraceRanked = 9,     // dispatch send, a row block: the entries of its tokens ranked
};

}  // namespace dc
