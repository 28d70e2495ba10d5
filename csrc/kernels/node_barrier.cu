// The node barrier of the internode NVLink hop (contract in node_barrier.hpp).
#include <cuda_runtime.h>

#include <string>

#include "../runtime/cuda_check.hpp"
#include "../runtime/wait.cuh"
#include "node_barrier.hpp"

namespace dc {

namespace {

__global__ void __launch_bounds__(kMaxNodeGpus) node_barrier_kernel(NodeBarrierArgs a, WaitCtx ctx_in) {
  const WaitCtx& ctx = ctx_in;  // its seq is the launch's number, from the host
  const int i = int(threadIdx.x);
  if (i >= a.gpus || i == a.local) return;
  ptx::fence_acq_rel_sys();
  ptx::st_release_sys_u64(a.peer_flags[i] + a.local, a.epoch);
  wait_flag_geq(a.flags + i, a.epoch, ctx, a.first_rank + i, kStageNodeBarrier);
}

}  // namespace

void launch_node_barrier(const NodeBarrierArgs& args, const WaitCtx& ctx, cudaStream_t stream) {
  DC_HOST_ASSERT(args.gpus >= 1 && args.gpus <= kMaxNodeGpus && args.local >= 0 && args.local < args.gpus,
                 "node_barrier: gpus must be in [1, " + std::to_string(kMaxNodeGpus) + "] and local in [0, gpus)");
  if (args.gpus == 1) return;
  node_barrier_kernel<<<1, kMaxNodeGpus, 0, stream>>>(args, ctx);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
