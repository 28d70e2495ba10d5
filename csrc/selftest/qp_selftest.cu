// Kernels behind tests/runtime/test_device_qp.py: post WQEs from GPU threads for a byte-for-byte comparison with the
// host encoders, and run traffic through the device emulated NIC.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "../runtime/cuda_check.hpp"
#include "../runtime/wait.cuh"
#include "../transport/device_qp.cuh"
#include "../transport/nic_serve.hpp"
#include "qp_selftest.hpp"

namespace dc {

using namespace transport;

namespace {

constexpr int kTrafficThreads = 32;

__global__ void qp_encode_kernel(uint8_t* base, DeviceQpLayout layout, uint32_t qpn, const QpTestWqe* specs, int n,
                                 uint32_t* indices, WaitCtx ctx_in) {
  const int i = threadIdx.x;
  if (i >= n) return;
  const WaitCtx ctx = ctx_in.resolved();
  const DeviceQp qp = DeviceQp::at(base, layout, qpn);
  const DeviceWaiter waiter{ctx, -1};
  const QpTestWqe s = specs[i];
  WqeCtrl c;
  c.fm_ce_se = s.fm_ce_se;
  c.signature = s.signature;
  c.imm = s.imm;
  uint32_t index = 0xffffffffu;
  switch (s.kind) {
    case kQpTestWrite:
    case kQpTestWriteImm:
      qp_post_write(qp, RdmaWrite{s.laddr, s.lkey, s.raddr, s.rkey, s.bytes}, c, s.kind == kQpTestWriteImm, waiter,
                    &index);
      break;
    case kQpTestInline:
      qp_post_write_inline(qp, s.payload, s.bytes, s.raddr, s.rkey, c, waiter, &index);
      break;
    default:
      qp_post_fetch_add(qp, FetchAdd{s.laddr, s.lkey, s.raddr, s.rkey, s.add}, c, waiter, &index);
  }
  indices[i] = index;
}

__device__ void traffic_poster(const QpTrafficArgs& a, int c, const WaitCtx& ctx, int peer) {
  qp_traffic_post(a, c, DeviceWaiter{ctx, peer});
  ptx::atom_add_release_gpu_u32(a.posters_done, 1u);  // even on failure: the NIC must not wait for us
}

__device__ void traffic_checker(const QpTrafficArgs& a, int c, const WaitCtx& ctx, int peer) {
  const int lane = threadIdx.x;
  for (int m = 0; m < a.messages; ++m) {
    const bool ok = wait_flag_geq(a.counters + c, uint64_t(m) + 1, ctx, peer, kStageQpSignal);
    if (!__all_sync(0xffffffffu, ok)) return;
    // The signal was fetch-added after the write of message m on the same queue: its bytes must be here now.
    const uint64_t off = (uint64_t(c) * a.messages + m) * a.slot_bytes;
    const uint32_t bytes = qp_test_message_bytes(c, m, a.slot_bytes, a.inline_every);
    bool same = true;
    for (uint32_t b = lane; b < bytes; b += 32) same &= a.recv[off + b] == a.peer_src[off + b];
    if (!__all_sync(0xffffffffu, same) && lane == 0) atomicAdd(a.mismatches, 1);
  }
}

// Blocks [0, channels): posters (lane 0). Block `channels`: the NIC (lane 0). The rest: checkers (whole warp).
__global__ void qp_traffic_kernel(QpTrafficArgs a, KeyTable keys, WaitCtx ctx_in, int peer) {
  const WaitCtx ctx = ctx_in.resolved();
  const int b = blockIdx.x;
  if (b < a.channels) {
    if (threadIdx.x == 0) traffic_poster(a, b, ctx, peer);
  } else if (b == a.channels) {
    if (threadIdx.x == 0) {
      const DeviceQp qp = DeviceQp::at(a.qp_base, a.layout, a.qpn);
      NicQueue q = qp.nic_view(a.start);
      nic_serve(q, keys, a.posters_done, a.nic_stop_target, DeviceWaiter{ctx, peer}, qp.nic_stats);
    }
  } else {
    traffic_checker(a, b - a.channels - 1, ctx, peer);
  }
}

}  // namespace

std::vector<uint32_t> run_qp_encode_selftest(uint8_t* qp_base, const DeviceQpLayout& layout, uint32_t qpn,
                                             const std::vector<QpTestWqe>& specs, const WaitCtx& ctx) {
  const int n = int(specs.size());
  DC_HOST_ASSERT(n > 0 && n <= 1024, "qp_encode_selftest: 1 to 1024 WQEs");
  QpTestWqe* d_specs = nullptr;
  uint32_t* d_indices = nullptr;
  DC_CUDA_CHECK(cudaMalloc(&d_specs, sizeof(QpTestWqe) * n));
  DC_CUDA_CHECK(cudaMalloc(&d_indices, sizeof(uint32_t) * n));
  std::vector<uint32_t> indices(n);
  cudaError_t err = cudaMemcpy(d_specs, specs.data(), sizeof(QpTestWqe) * n, cudaMemcpyHostToDevice);
  if (err == cudaSuccess) {
    qp_encode_kernel<<<1, n>>>(qp_base, layout, qpn, d_specs, n, d_indices, ctx);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = cudaMemcpy(indices.data(), d_indices, sizeof(uint32_t) * n, cudaMemcpyDeviceToHost);
  cudaFree(d_specs);
  cudaFree(d_indices);
  DC_CUDA_CHECK(err);
  return indices;
}

void launch_qp_traffic(const QpTrafficArgs& args, const KeyTable& keys, const WaitCtx& ctx, int peer,
                       cudaStream_t stream) {
  int device = 0, sms = 0;
  DC_CUDA_CHECK(cudaGetDevice(&device));
  DC_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int blocks = 2 * args.channels + 1;
  // The NIC block spins while posters and checkers run: all blocks must be resident at once.
  DC_HOST_ASSERT(args.channels >= 1 && blocks <= sms,
                 "qp_traffic: channels must be in [1, (SMs - 1) / 2] = [1, " + std::to_string((sms - 1) / 2) + "]");
  qp_traffic_kernel<<<blocks, kTrafficThreads, 0, stream>>>(args, keys, ctx, peer);
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
