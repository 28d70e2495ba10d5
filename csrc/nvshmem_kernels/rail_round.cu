// The GPU-issued exchange round of NvshmemTransport (rail_round.hpp). Compiled only into deepcomm._nvshmem_kernels
// (relocatable device code, NVSHMEM's device library).
#include <nvshmem.h>
#include <nvshmemx.h>

#include "../runtime/cuda_check.hpp"
#include "../runtime/wait.cuh"
#include "rail_round.hpp"

namespace dc {

__global__ void __launch_bounds__(kRailRoundThreads) rail_round_kernel(const __grid_constant__ RailRoundArgs a,
                                                                       const WaitCtx ctx) {
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
  // 1. credits first: a peer may be waiting for them already
  for (int j = tid; j < a.num_peers; j += kRailRoundThreads)
    nvshmemx_signal_op(a.credit + a.rank, a.round, NVSHMEM_SIGNAL_SET, a.peers[j].pe);
  bool issued = false;
  for (int j = warp; j < a.num_peers; j += kRailRoundThreads / 32) {  // warp-uniform: one warp per peer
    const RailRoundPeer p = a.peers[j];
    bool ok = true;
    if (lane == 0) ok = wait_flag_geq(a.credit + p.pe, a.round, ctx, p.pe, kStageNvshmemCredit);
    ok = __shfl_sync(0xffffffffu, ok, 0);
    if (!ok) continue;
    uint64_t* sig = a.signal + a.rank;
    if (p.bytes > 0) {
      nvshmemx_putmem_signal_nbi_warp(a.recv + int64_t(a.rank) * a.slot_bytes, a.send + p.begin, size_t(p.bytes),
                                      sig, a.landed, NVSHMEM_SIGNAL_SET, p.pe);
    } else if (lane == 0) {
      nvshmemx_signal_op(sig, a.landed, NVSHMEM_SIGNAL_SET, p.pe);
    }
    __syncwarp();
    issued = true;
  }
  if (issued && lane == 0) nvshmem_quiet();
}

void launch_rail_round(const RailRoundArgs& args, const WaitCtx& ctx, cudaStream_t stream) {
  DC_HOST_ASSERT(args.num_peers >= 0 && args.num_peers <= kRailRoundMaxPeers, "rail_round: too many peers");
  rail_round_kernel<<<1, kRailRoundThreads, 0, stream>>>(args, ctx);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
