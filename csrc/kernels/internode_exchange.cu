// One round of the internode exchange (contract in internode_exchange.hpp): blocks [0, P) post, one thread
// each; blocks [P, 2P) are the NICs of the P queue pairs (nic_serve_block.cuh).
#include <cuda_runtime.h>

#include <string>

#include "../runtime/cuda_check.hpp"
#include "../runtime/wait.cuh"
#include "../transport/device_qp.cuh"
#include "../transport/nic_serve_block.cuh"
#include "internode_exchange.hpp"

namespace dc {

using namespace transport;

namespace {

constexpr int kThreads = 256;

// The signal after the block (same queue: it executes after the writes), then wait for all our WQEs.
__device__ bool signal_and_quiet(const InternodeExchangeArgs& a, const InternodePeer& p, const DeviceQp& qp,
                                 const DeviceWaiter& waiter) {
  const WqeCtrl signaled;
  uint32_t index = 0;
  return qp_post_fetch_add(qp, FetchAdd{p.fa_old_addr + 8, a.lkey, p.signal_addr, uint32_t(p.rkey), 1}, signaled,
                           waiter, &index) &&
         qp_quiet(qp, index + wqebbs_of_ds(kDsFetchAdd), waiter);
}

__device__ bool post_round(const InternodeExchangeArgs& a, const InternodePeer& p, const DeviceQp& qp,
                           const DeviceWaiter& waiter) {
  const int peer = int(p.rank);
  const uint32_t rkey = uint32_t(p.rkey);
  const WqeCtrl signaled;  // every WQE completes: retirement never waits on a later signal
  bool ok = qp_post_fetch_add(qp, FetchAdd{p.fa_old_addr, a.lkey, p.credit_addr, rkey, 1}, signaled, waiter);
  ok = ok && wait_flag_geq(reinterpret_cast<const uint64_t*>(p.credit_ptr), a.round, waiter.ctx, peer,
                           kStageInternodeCredit);
  if (ok && p.send_bytes != 0 && p.send_bytes <= kMaxInlineBytes) {
    // Small blocks (the count exchange) travel inside the WQE. Our send area is registered at its own address,
    // so the WQE address is also our pointer to the payload.
    return qp_post_write_inline(qp, reinterpret_cast<const uint8_t*>(p.send_addr), uint32_t(p.send_bytes),
                                p.recv_addr, rkey, signaled, waiter) &&
           signal_and_quiet(a, p, qp, waiter);
  }
  for (uint64_t off = 0; ok && off < p.send_bytes; off += a.chunk_bytes) {
    const uint64_t left = p.send_bytes - off;
    const uint32_t n = uint32_t(left < a.chunk_bytes ? left : a.chunk_bytes);
    ok = qp_post_write(qp, RdmaWrite{p.send_addr + off, a.lkey, p.recv_addr + off, rkey, n}, signaled, false,
                       waiter);
  }
  return ok && signal_and_quiet(a, p, qp, waiter);
}

__global__ void __launch_bounds__(kThreads) internode_exchange_kernel(InternodeExchangeArgs a, KeyTable keys,
                                                                      WaitCtx ctx_in) {
  const WaitCtx ctx = ctx_in.resolved();
  const bool is_nic = int(blockIdx.x) >= a.num_peers;
  const InternodePeer p = a.peers[is_nic ? blockIdx.x - a.num_peers : blockIdx.x];
  const DeviceQp qp = DeviceQp::at(reinterpret_cast<uint8_t*>(p.qp_base),
                                   DeviceQpLayout::make(a.log_wqebbs, a.log_cqes), uint32_t(p.qpn));
  const DeviceWaiter waiter{ctx, int(p.rank)};
  auto* stop = reinterpret_cast<uint32_t*>(p.stop_ptr);
  if (is_nic) {
    nic_serve_block(qp, keys, stop, uint32_t(a.round), waiter, reinterpret_cast<NicTotals*>(p.totals_ptr));
    return;
  }
  if (threadIdx.x != 0) return;
  post_round(a, p, qp, waiter);
  ptx::atom_add_release_gpu_u32(stop, 1u);  // even after a failure: our NIC must not wait for more posts
  // The peer's block for us: its NIC raised our signal after writing it.
  wait_flag_geq(reinterpret_cast<const uint64_t*>(p.signal_ptr), a.round, ctx, int(p.rank), kStageQpSignal);
}

}  // namespace

void launch_internode_exchange(const InternodeExchangeArgs& args, const KeyTable& keys, const WaitCtx& ctx,
                               cudaStream_t stream) {
  int device = 0, sms = 0;
  DC_CUDA_CHECK(cudaGetDevice(&device));
  DC_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int blocks = 2 * args.num_peers;
  // NIC blocks spin while the posters run: every block must be resident at once.
  DC_HOST_ASSERT(args.num_peers >= 1 && blocks <= sms,
                 "internode_exchange: peers must be in [1, " + std::to_string(sms / 2) + "]");
  DC_HOST_ASSERT(args.chunk_bytes >= 16 && args.chunk_bytes % 16 == 0, "internode_exchange: chunk_bytes % 16");
  internode_exchange_kernel<<<blocks, kThreads, 0, stream>>>(args, keys, ctx);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
