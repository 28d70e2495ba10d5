// Copy probes: rows moved from one buffer to another by each means the dispatch and combine kernels could use,
// on a chosen number of SMs (one block each), so that dev/profile_copy.py can time what a few SMs reach.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dc {

constexpr int kProbeMaxBars = 64;  // bulk probe: producers x slots barriers per block

struct CopyProbe {
  const void* src = nullptr;
  void* dst = nullptr;
  int64_t rows = 0, row_bytes = 0;  // row_bytes a multiple of 16, both buffers 16-byte aligned
  int blocks = 1;
  // vectors: threads per block, 16-byte vectors each lane holds in flight, the loads' L2 256-byte fetch hint
  int threads = 512, unroll = 8;
  bool l2_hint = false;
  // bulk: producer warps per block (their lane 0 issues), chunk slots each, chunk bytes (0: a whole row)
  int producers = 1, slots = 4, chunk = 0;
  bool lane0_waits = false;  // ring: only lane 0 polls a chunk's barrier
};

// kind: "vectors" (every lane loads and stores 16-byte vectors), "bulk" (bulk copies through shared memory),
// "ring" (the bulk reducers' pattern: bulk loads into a warp's ring, every lane reads shared memory and stores),
// "memcpy" (cudaMemcpyAsync of the whole buffer: the copy engine's or the driver's own path).
void launch_copy_probe(const char* kind, const CopyProbe& p, cudaStream_t stream);

}  // namespace dc
