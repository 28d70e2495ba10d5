// How the bindings read Python's ints: pointers, streams, events, and a call's agreement words.
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <cstdint>

#include "../runtime/agree_record.hpp"

namespace dc::bindings {

template <typename T>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }
inline cudaStream_t stream_of(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }
inline cudaEvent_t event_of(uintptr_t e) { return reinterpret_cast<cudaEvent_t>(e); }

// A call's words from Python (agreement.WORDS ints; all zeros: the call takes no part in agreement).
using Words = std::array<int32_t, kFingerprintWords>;
inline Fingerprint fingerprint_of(const Words& w) {
  Fingerprint f{};
  for (int i = 0; i < kFingerprintWords; ++i) f.w[i] = w[size_t(i)];
  return f;
}

// Flags of NvlContext.dispatch_call (deepcomm/nvlink/backend.py names them; exported as DISPATCH_FLAGS).
enum DispatchFlag : int {
  kCallBegin = 1, kCallNotify = 2, kCallBump = 4, kCallPayload = 8, kCallWait = 16, kCallFinish = 32,
  kCallWaitCaller = 64, kCallCallerWaits = 128, kCallReportInvalid = 256,
};

}  // namespace dc::bindings
