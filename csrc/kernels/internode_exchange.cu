// One round of the internode exchange (contract in internode_exchange.hpp): blocks [0, P) post, one thread
// each (internode_round.hpp); blocks [P, P + P * nic_blocks) are the NICs of the P queue pairs, nic_blocks each
// (nic_serve_block.cuh).
#include <cuda_runtime.h>

#include <string>

#include "../runtime/cuda_check.hpp"
#include "../runtime/wait.cuh"
#include "../transport/device_qp.cuh"
#include "../transport/nic_serve_block.cuh"
#include "internode_exchange.hpp"
#include "internode_round.hpp"

namespace dc {

using namespace transport;

namespace {

constexpr int kThreads = 512;  // the NIC blocks copy with all of them; posting uses one

__global__ void __launch_bounds__(kThreads) internode_exchange_kernel(InternodeExchangeArgs a, KeyTable keys,
                                                                      WaitCtx ctx_in) {
  const WaitCtx& ctx = ctx_in;  // its seq is the launch's number, from the host
  const bool is_nic = int(blockIdx.x) >= a.num_peers;
  const int nic = int(blockIdx.x) - a.num_peers;  // NIC block index: queue nic / nic_blocks
  const InternodePeer p = a.peers[is_nic ? nic / a.nic_blocks : int(blockIdx.x)];
  const DeviceQp qp = DeviceQp::at(reinterpret_cast<uint8_t*>(p.qp_base),
                                   DeviceQpLayout::make(a.log_wqebbs, a.log_cqes), uint32_t(p.qpn));
  const DeviceWaiter waiter{ctx, int(p.rank)};
  auto* stop = reinterpret_cast<uint32_t*>(p.stop_ptr);
  if (is_nic) {
    nic_crew_block(nic % a.nic_blocks, a.nic_blocks, qp, keys, stop, uint32_t(a.round), waiter,
                   reinterpret_cast<NicTotals*>(p.totals_ptr), reinterpret_cast<NicCrew*>(p.crew_ptr));
    return;
  }
  if (threadIdx.x != 0) return;
  internode_post_round(a, p, qp, waiter);
  ptx::atom_add_release_gpu_u32(stop, 1u);  // even after a failure: our NIC must not wait for more posts
  // The peer's block for us: its NIC raised our signal after writing it.
  internode_wait_counter(reinterpret_cast<const uint64_t*>(p.signal_ptr), a.round, waiter, kStageQpSignal);
}

}  // namespace

void launch_internode_exchange(const InternodeExchangeArgs& args, const KeyTable& keys, const WaitCtx& ctx,
                               cudaStream_t stream) {
  int device = 0, sms = 0;
  DC_CUDA_CHECK(cudaGetDevice(&device));
  DC_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  DC_HOST_ASSERT(args.nic_blocks >= 1 && args.nic_blocks <= kNicMaxBlocks,
                 "internode_exchange: nic_blocks must be in [1, " + std::to_string(kNicMaxBlocks) + "]");
  const int blocks = args.num_peers * (1 + args.nic_blocks);
  // NIC blocks spin while the posters run: every block must be resident at once.
  DC_HOST_ASSERT(args.num_peers >= 1 && blocks <= sms,
                 "internode_exchange: peers * (1 + nic_blocks) must be in [2, " + std::to_string(sms) + "]");
  DC_HOST_ASSERT(args.chunk_bytes >= 16 && args.chunk_bytes % 16 == 0, "internode_exchange: chunk_bytes % 16");
  internode_exchange_kernel<<<blocks, kThreads, 0, stream>>>(args, keys, ctx);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
