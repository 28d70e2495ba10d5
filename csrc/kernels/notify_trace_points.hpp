// The numbered points the notify kernel stamps when tracing; kNotifyTracePoints and the names are exported as
// NOTIFY_TRACE_POINTS and NOTIFY_TRACE_NAMES.
#pragma once

namespace dc {

// Diagnostics (dev/profile_kernels.py --sweep, NvlContext.set_notify_trace): thread 0 of every block that passes a
// point writes {globaltimer ns, its SM's clock64} into trace[block][point][0..1]; nothing when trace is null. A
// point after a __syncthreads of the whole block is stamped after it, so it marks the block's phase done, not
// thread 0's. Points 3 onwards are passed by the last block only (the one that took the last ticket).
constexpr int kNotifyTracePoints = 8;
constexpr int kNotifyTraceBlocks = 256;  // blocks a trace has room for: notify.cu's most (static_assert there)
enum NotifyTracePoint : int {
  kNotifyTraceEntry = 0,     // kernel entry
  kNotifyTraceCounted = 1,   // the block's tokens' ranks and experts counted, warp counts in shared memory
  kNotifyTraceTicket = 2,    // block counts published, earlier chunks' counts added, sums published, the ticket taken
  kNotifyTracePrefixes = 3,  // last block: totals and the call's number
  kNotifyTraceSent = 4,      // counts stored at every peer, fenced, the counts' flag released
  kNotifyTraceAgreed = 5,    // every rank's call words compared (right after point 4 when the call has none)
  kNotifyTraceFlags = 6,     // every peer's counts' flag seen
  kNotifyTraceHost = 7,      // results written: device counts, and the tagged counts in mapped host memory
};
constexpr const char* kNotifyTraceNames[kNotifyTracePoints] = {
    "entry", "ids counted", "ticket taken", "totals done", "counts sent + flag released", "agreement done",
    "peers' flags seen", "host counts written"};

}  // namespace dc
