// GPU threads posting to a device queue pair: the generic poster (qp_poster.hpp) with waits bounded by
// wait_until, so a stuck queue records (rank, peer, stage) in the WaitCtx's error record and the post returns
// false instead of hanging.
#pragma once
#include "../runtime/wait.cuh"
#include "qp_poster.hpp"

namespace dc::transport {

struct DeviceWaiter {
  const WaitCtx& ctx;
  int peer;  // the rank the queue leads to, for the error record

  // Host-device only so that the generic DC_HD poster compiles for both sides; only ever called on the device.
  template <typename Done>
  __host__ __device__ bool wait(Done done, int stage) const {
#if defined(__CUDA_ARCH__)
    return wait_until(done, ctx, peer, stage);
#else
    return false;
#endif
  }
  __host__ __device__ void fail(int stage) const {
#if defined(__CUDA_ARCH__)
    report_input_error(ctx, peer, stage);
#endif
  }
};

}  // namespace dc::transport
