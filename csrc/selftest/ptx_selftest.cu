// Exercises every ptx/ helper on the GPU so tests can compare with the plain C++ twins (tests/runtime/test_ptx.py).
#include <cuda_runtime.h>

#include <cstring>

#include "../../ptx/ptx.cuh"
#include "../runtime/cuda_check.hpp"
#include "ptx_selftest.hpp"

namespace dc {

namespace {

__global__ void ptx_selftest_kernel(const uint64_t* in, PtxSelftest* out, uint64_t* scratch, const int4* src, int4* dst) {
  const int tid = threadIdx.x, lane = tid & 31;
  if (tid < kSelftestValues) {
    out->bswap32[tid] = ptx::bswap32(uint32_t(in[tid]));
    out->bswap64[tid] = ptx::bswap64(in[tid]);
  }
  // release/acquire and relaxed round trips at sys and gpu scope
  if (tid == 0) {
    ptx::st_release_sys_u64(scratch + 0, in[0]);
    out->acquire_sys = ptx::ld_acquire_sys_u64(scratch + 0);
    ptx::st_release_gpu_u64(scratch + 1, in[1]);
    out->acquire_gpu = ptx::ld_acquire_gpu_u64(scratch + 1);
    ptx::st_relaxed_sys_u64(scratch + 2, in[2]);
    out->relaxed_sys = ptx::ld_relaxed_sys_u64(scratch + 2);
    ptx::st_na_u64(scratch + 3, in[3]);
    ptx::st_release_sys_u32(reinterpret_cast<uint32_t*>(scratch + 4), uint32_t(in[4]));
    out->acquire_sys_u32 = ptx::ld_acquire_sys_u32(reinterpret_cast<const uint32_t*>(scratch + 4));
    out->volatile_s32 = ptx::ld_volatile_s32(reinterpret_cast<const int*>(scratch + 4));
    ptx::fence_acq_rel_sys();
    ptx::fence_acq_rel_gpu();
    ptx::fence_sc_sys();
  }
  __syncthreads();
  // every thread adds its index + 1
  ptx::atom_add_release_sys_u64(scratch + 5, uint64_t(tid + 1));
  ptx::atom_add_relaxed_gpu_u64(scratch + 6, uint64_t(tid + 1));
  ptx::atom_add_release_gpu_u32(reinterpret_cast<uint32_t*>(scratch + 7), uint32_t(tid + 1));
  // 16-byte copies through each load/store flavour
  for (int i = tid; i < kSelftestVectors; i += blockDim.x) {
    int4 v = ptx::ld_nc_na_v4(src + i);
    ptx::st_na_v4(dst + i, v);
  }
  __syncthreads();
  for (int i = tid; i < kSelftestVectors; i += blockDim.x) {
    int4 a = ptx::ld_volatile_v4(dst + i), b = ptx::ld_relaxed_gpu_v4(dst + i);
    const uint2 c = ptx::ld_relaxed_gpu_v2(reinterpret_cast<const uint2*>(dst + i) + 1);
    const uint32_t d = ptx::ld_relaxed_gpu_u32(reinterpret_cast<const uint32_t*>(dst + i) + 1);
    out->copy_match += (a.x == b.x && a.y == b.y && a.z == b.z && a.w == b.w) ? 0 : 1;
    out->copy_match += (uint32_t(a.z) == c.x && uint32_t(a.w) == c.y && uint32_t(a.y) == d) ? 0 : 1;
    dst[kSelftestVectors + i] = a;
  }
  if (tid < 32) out->lanemask_lt[lane] = ptx::lanemask_lt();
  // named barrier among the first 64 threads only
  if (tid < 64) {
    if (tid == 0) scratch[8] = 7;
    ptx::named_barrier_sync(1, 64);
    if (tid == 63) out->named_barrier_seen = scratch[8];
  }
  __syncthreads();
  // a bulk copy through shared memory: src -> shared (on a barrier) -> dst's third part, in two chunks
  __shared__ __align__(128) int4 bulk_buf[kSelftestVectors];
  __shared__ uint64_t bulk_bar;
  if (tid == 0) {
    constexpr uint32_t half = kSelftestVectors / 2 * sizeof(int4);
    ptx::mbar_init(&bulk_bar, 1);
    ptx::fence_mbar_init();
    for (uint32_t phase = 0; phase < 2; ++phase) {
      ptx::mbar_expect_bytes(&bulk_bar, half);
      ptx::bulk_load(bulk_buf + phase * kSelftestVectors / 2, src + phase * kSelftestVectors / 2, half, &bulk_bar);
      while (!ptx::mbar_try_wait(&bulk_bar, phase)) {
      }
      ptx::bulk_store(dst + 2 * kSelftestVectors + phase * kSelftestVectors / 2, bulk_buf + phase * kSelftestVectors / 2,
                      half);
      ptx::bulk_commit();
    }
    ptx::bulk_wait_read<0>();
    ptx::bulk_wait_all();
    ptx::mbar_inval(&bulk_bar);
  }
  __syncthreads();
  if (tid == 0) {
    auto* cas = reinterpret_cast<uint32_t*>(scratch + 9);
    out->cas_old_first = ptx::atom_cas_acquire_sys_u32(cas, 0u, 5u);   // succeeds: 0 -> 5
    out->cas_old_second = ptx::atom_cas_release_sys_u32(cas, 0u, 9u);  // fails: stays 5
    out->cas_final = *cas;
    out->add_sys = scratch[5];
    out->add_gpu = scratch[6];
    out->add_gpu_u32 = *reinterpret_cast<uint32_t*>(scratch + 7);
    out->na_u64 = scratch[3];
    const uint64_t t0 = ptx::globaltimer_ns();
    uint64_t t1 = t0;
    while (t1 == t0) t1 = ptx::globaltimer_ns();
    out->timer_advanced = t1 > t0 ? 1 : 0;
  }
}

}  // namespace

PtxSelftest run_ptx_selftest(const uint64_t* values) {
  uint64_t *in = nullptr, *scratch = nullptr;
  PtxSelftest* out = nullptr;
  int4 *src = nullptr, *dst = nullptr;
  DC_CUDA_CHECK(cudaMalloc(&in, kSelftestValues * sizeof(uint64_t)));
  DC_CUDA_CHECK(cudaMalloc(&scratch, 16 * sizeof(uint64_t)));
  DC_CUDA_CHECK(cudaMalloc(&out, sizeof(PtxSelftest)));
  DC_CUDA_CHECK(cudaMalloc(&src, kSelftestVectors * sizeof(int4)));
  DC_CUDA_CHECK(cudaMalloc(&dst, 3 * kSelftestVectors * sizeof(int4)));
  DC_CUDA_CHECK(cudaMemcpy(in, values, kSelftestValues * sizeof(uint64_t), cudaMemcpyHostToDevice));
  DC_CUDA_CHECK(cudaMemset(scratch, 0, 16 * sizeof(uint64_t)));
  DC_CUDA_CHECK(cudaMemset(out, 0, sizeof(PtxSelftest)));
  // source vectors: the input values repeated, so the copy check sees non-zero, varied bytes
  int4 host_src[kSelftestVectors];
  for (int i = 0; i < kSelftestVectors; ++i) std::memcpy(&host_src[i], values + (2 * i) % kSelftestValues, 8),
      std::memcpy(reinterpret_cast<char*>(&host_src[i]) + 8, values + (2 * i + 1) % kSelftestValues, 8);
  DC_CUDA_CHECK(cudaMemcpy(src, host_src, sizeof(host_src), cudaMemcpyHostToDevice));
  ptx_selftest_kernel<<<1, kSelftestThreads>>>(in, out, scratch, src, dst);
  DC_CUDA_CHECK(cudaGetLastError());
  DC_CUDA_CHECK(cudaDeviceSynchronize());
  PtxSelftest result;
  DC_CUDA_CHECK(cudaMemcpy(&result, out, sizeof(result), cudaMemcpyDeviceToHost));
  int4 host_dst[3 * kSelftestVectors];
  DC_CUDA_CHECK(cudaMemcpy(host_dst, dst, sizeof(host_dst), cudaMemcpyDeviceToHost));
  result.copy_match += std::memcmp(host_dst, host_src, sizeof(host_src)) == 0 ? 0 : 1000;
  result.copy_match += std::memcmp(host_dst + kSelftestVectors, host_src, sizeof(host_src)) == 0 ? 0 : 1000;
  result.copy_match += std::memcmp(host_dst + 2 * kSelftestVectors, host_src, sizeof(host_src)) == 0 ? 0 : 100000;
  cudaFree(in); cudaFree(scratch); cudaFree(out); cudaFree(src); cudaFree(dst);
  return result;
}

}  // namespace dc
