// Bounded wait on a local array of per-peer counters (contract in counter_wait.hpp).
#include <cuda_runtime.h>

#include <string>

#include "../runtime/cuda_check.hpp"
#include "../runtime/wait.cuh"
#include "counter_wait.hpp"

namespace dc {
namespace {

__global__ void counter_wait_kernel(CounterWaitArgs a, WaitCtx ctx_in) {
  const WaitCtx& ctx = ctx_in;  // its seq is the launch's number, from the host
  const int p = int(threadIdx.x);
  if (p >= a.world_size || p == a.rank || !((a.peer_mask[p / 32] >> (p % 32)) & 1u)) return;
  wait_flag_geq(a.counters + p, a.target, ctx, p, a.stage);  // a timeout is recorded; the host raises it
}

}  // namespace

void launch_counter_wait(const CounterWaitArgs& args, const WaitCtx& ctx, cudaStream_t stream) {
  DC_HOST_ASSERT(args.world_size >= 1 && args.world_size <= kMaxCounterWaitRanks,
                 "counter_wait: world_size must be in [1, " + std::to_string(kMaxCounterWaitRanks) + "]");
  DC_HOST_ASSERT(args.rank >= 0 && args.rank < args.world_size, "counter_wait: rank outside [0, world_size)");
  DC_HOST_ASSERT(args.counters != nullptr && ctx.err != nullptr, "counter_wait: null counters or error record");
  DC_HOST_ASSERT(reinterpret_cast<uintptr_t>(args.counters) % 8 == 0, "counter_wait: counters not 8-byte aligned");
  const int threads = (args.world_size + 31) / 32 * 32;
  counter_wait_kernel<<<1, threads, 0, stream>>>(args, ctx);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
