// Diagnostics: host timestamps at the points of a dispatch crossing (dev/profile_host_parts.py), so that the host
// time of a call can be split where Python cannot see: argument conversion, stream order, each launch, the wait
// for the counts, the output views, the result. CLOCK_MONOTONIC nanoseconds, the clock of Python's
// time.monotonic_ns. Written where NvlContext::host_stamps points; null (the default): one branch per point.
#pragma once
#include <time.h>

#include <cstdint>

namespace dc {

constexpr int kHostStampPoints = 8;
enum HostStampPoint : int {
  kStampEntry = 0,    // the binding's body entered: Python's arguments converted
  kStampBegun = 1,    // the stream order's waits queued (StreamOrder::begin)
  kStampNotify = 2,   // the notify kernel (or the fused one) launched
  kStampPayload = 3,  // the payload kernel launched
  kStampWaited = 4,   // the counts seen in mapped host memory (or no wait)
  kStampDone = 5,     // the result filled, the end event recorded: nvl_dispatch returns
  kStampViews = 6,    // the output block trimmed, its views made
  kStampResult = 7,   // the result tuple built: the binding returns
};
constexpr const char* kHostStampNames[kHostStampPoints] = {
    "entry", "stream order", "notify launched", "payload launched", "counts seen", "result filled",
    "views made", "tuple built"};

inline void host_stamp(int64_t* stamps, int point) {
  if (stamps == nullptr) return;
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  stamps[point] = int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

}  // namespace dc
