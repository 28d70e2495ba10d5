// Launch probes (contract in launch_probe.hpp).
#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

#include "../runtime/cuda_check.hpp"
#include "../runtime/pdl_launch.hpp"
#include "launch_probe.hpp"

namespace dc {
namespace {

constexpr int kBatch = 64;

struct WideArgs {  // the size of the dispatch kernel's arguments (DispatchArgs, NvlLayout, Peers, WaitCtx)
  unsigned char bytes[448];
};

__global__ void small_kernel(int* out) {
  if (out != nullptr && threadIdx.x == 0 && blockIdx.x == 0) *out = 1;
}

__global__ void wide_kernel(WideArgs a) {
  if (a.bytes[0] == 255 && threadIdx.x == 0) __trap();  // never: the argument is all zeros
}

double median_ns(int batches, cudaStream_t stream, const std::function<void()>& op) {
  std::vector<double> per_op;
  for (int b = 0; b < batches + 1; ++b) {
    DC_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kBatch; ++i) op();
    const auto t1 = std::chrono::steady_clock::now();
    if (b > 0) per_op.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / kBatch);  // b 0: warm-up
  }
  DC_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::sort(per_op.begin(), per_op.end());
  return per_op[per_op.size() / 2];
}


}  // namespace

std::map<std::string, double> launch_probe(int batches, cudaStream_t stream) {
  DC_HOST_ASSERT(batches >= 1, "launch_probe: batches must be >= 1");
  const WideArgs wide{};
  cudaEvent_t ev;
  DC_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  std::map<std::string, double> out;
  out["<<<>>> 1 block, 8-byte argument"] = median_ns(batches, stream, [&] {
    small_kernel<<<1, 32, 0, stream>>>(nullptr);
  });
  out["<<<>>> 24 blocks, 448-byte argument"] = median_ns(batches, stream, [&] {
    wide_kernel<<<24, 128, 0, stream>>>(wide);
  });
  // as the library's launch_kernel makes them (runtime/pdl_launch.hpp)
  out["cudaLaunchKernelEx 24 blocks, 448 bytes"] = median_ns(batches, stream, [&] {
    launch_kernel(wide_kernel, 24, 128, 0, stream, false, wide);
  });
  out["cudaLaunchKernelEx 24 blocks, 448 bytes, PDL"] = median_ns(batches, stream, [&] {
    launch_kernel(wide_kernel, 24, 128, 0, stream, true, wide);
  });
  out["cudaEventRecord"] = median_ns(batches, stream, [&] { DC_CUDA_CHECK(cudaEventRecord(ev, stream)); });
  out["cudaStreamWaitEvent"] = median_ns(batches, stream, [&] { DC_CUDA_CHECK(cudaStreamWaitEvent(stream, ev, 0)); });
  out["cudaGetLastError"] = median_ns(batches, stream, [] { (void)cudaGetLastError(); });
  out["clock only"] = median_ns(batches, stream, [] {});
  DC_CUDA_CHECK(cudaEventDestroy(ev));
  return out;
}

}  // namespace dc
