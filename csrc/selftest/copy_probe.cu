// The copy probes of copy_probe.hpp. Rows are spread over the warps (vectors) or producers (bulk) as the dispatch
// kernel spreads tokens: row r to warp r mod (all warps), block-major.
#include "copy_probe.hpp"

#include <cstring>
#include <stdexcept>
#include <string>

#include "../../ptx/bulk.cuh"
#include "../../ptx/ld_st.cuh"
#include "../runtime/cuda_check.hpp"
#include "../runtime/smem_opt_in.hpp"

namespace dc {
namespace {

template <int kUnroll, bool kL2Hint, int kMaxThreads>
__global__ void __launch_bounds__(kMaxThreads) probe_vectors(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t row_bytes) {
  const int lane = threadIdx.x & 31, warps_per_block = blockDim.x >> 5;
  const int64_t warps = int64_t(gridDim.x) * warps_per_block, n16 = row_bytes / 16;
  for (int64_t r = int64_t(blockIdx.x) * warps_per_block + (threadIdx.x >> 5); r < rows; r += warps) {
    const int4* s = reinterpret_cast<const int4*>(src + r * row_bytes);
    int4* d = reinterpret_cast<int4*>(dst + r * row_bytes);
    for (int64_t base = lane; base < n16; base += 32 * kUnroll) {
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * 32;
        if (i < n16) v[u] = kL2Hint ? ptx::ld_nc_na_l2_256_v4(s + i) : ptx::ld_nc_na_v4(s + i);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * 32;
        if (i < n16) ptx::st_na_v4(d + i, v[u]);
      }
    }
  }
}

// Each producer's stream of chunks: loads run slots - 1 chunks ahead of the stores.
__global__ void probe_bulk(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t row_bytes, int slots,
                           int chunk) {
  extern __shared__ __align__(128) uint8_t ring_all[];
  __shared__ uint64_t bars_all[kProbeMaxBars];
  if ((threadIdx.x & 31) != 0) return;
  const int producer = threadIdx.x >> 5, producers = blockDim.x >> 5;
  uint8_t* ring = ring_all + int64_t(producer) * slots * chunk;
  uint64_t* bars = bars_all + producer * slots;
  const int per_row = int((row_bytes + chunk - 1) / chunk);
  const int64_t first = int64_t(blockIdx.x) * producers + producer, step = int64_t(gridDim.x) * producers;
  const int64_t total = first < rows ? ((rows - 1 - first) / step + 1) * per_row : 0;
  for (int s = 0; s < slots; ++s) ptx::mbar_init(bars + s, 1);
  ptx::fence_mbar_init();
  const auto bytes_of = [&](int64_t i) {
    const int c = int(i % per_row);
    return uint32_t(c + 1 < per_row ? chunk : row_bytes - int64_t(c) * chunk);
  };
  const auto offset_of = [&](int64_t i) { return (first + i / per_row * step) * row_bytes + i % per_row * chunk; };
  const auto issue = [&](int64_t i) {
    const int slot = int(i % slots);
    ptx::mbar_expect_bytes(bars + slot, bytes_of(i));
    ptx::bulk_load(ring + int64_t(slot) * chunk, src + offset_of(i), bytes_of(i), bars + slot);
  };
  int64_t issued = 0;
  for (; issued < total && issued < slots - 1; ++issued) issue(issued);
  for (int64_t i = 0; i < total; ++i) {
    const int slot = int(i % slots);
    while (!ptx::mbar_try_wait(bars + slot, uint32_t(i / slots) & 1u)) {
    }
    ptx::bulk_store(dst + offset_of(i), ring + int64_t(slot) * chunk, bytes_of(i));
    ptx::bulk_commit();
    if (issued < total) {
      // the slot to refill held chunk i - 1: its group (the second newest) must have read it
      if (issued >= slots) ptx::bulk_wait_read<1>();
      issue(issued++);
    }
  }
  ptx::bulk_wait_all();
  for (int s = 0; s < slots; ++s) ptx::mbar_inval(bars + s);
}

// "ring": the bulk reducers' pattern (combine_bulk_reduce.cuh): lane 0 keeps `slots` chunk loads in flight into
// the warp's ring, every lane reads each chunk from shared memory and stores it with 16-byte vector stores. lane0_waits: only lane 0 waits on a chunk's barrier, the
// others wait at a __syncwarp, instead of every lane polling the barrier.
__global__ void probe_ring(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t row_bytes, int slots, int chunk,
                           bool lane0_waits) {
  extern __shared__ __align__(128) uint8_t ring_all[];
  __shared__ uint64_t bars_all[kProbeMaxBars];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  uint8_t* ring = ring_all + int64_t(warp) * slots * chunk;
  uint64_t* bars = bars_all + warp * slots;
  const int per_row = int((row_bytes + chunk - 1) / chunk);
  const int64_t first = int64_t(blockIdx.x) * warps + warp, step = int64_t(gridDim.x) * warps;
  const int64_t total = first < rows ? ((rows - 1 - first) / step + 1) * per_row : 0;
  if (lane == 0) {
    for (int s = 0; s < slots; ++s) ptx::mbar_init(bars + s, 1);
    ptx::fence_mbar_init();
  }
  __syncwarp();
  const auto bytes_of = [&](int64_t i) {
    const int c = int(i % per_row);
    return uint32_t(c + 1 < per_row ? chunk : row_bytes - int64_t(c) * chunk);
  };
  const auto offset_of = [&](int64_t i) { return (first + i / per_row * step) * row_bytes + i % per_row * chunk; };
  int64_t issued = 0;
  const auto refill = [&](int64_t consumed) {
    for (; issued < total && issued < consumed + slots; ++issued)
      if (lane == 0) {
        const int slot = int(issued % slots);
        ptx::mbar_expect_bytes(bars + slot, bytes_of(issued));
        ptx::bulk_load(ring + int64_t(slot) * chunk, src + offset_of(issued), bytes_of(issued), bars + slot);
      }
  };
  refill(0);
  for (int64_t i = 0; i < total; ++i) {
    const int slot = int(i % slots);
    if (!lane0_waits || lane == 0)
      while (!ptx::mbar_try_wait(bars + slot, uint32_t(i / slots) & 1u)) {
      }
    if (lane0_waits) __syncwarp();
    const int4* in = reinterpret_cast<const int4*>(ring + int64_t(slot) * chunk);
    int4* out = reinterpret_cast<int4*>(dst + offset_of(i));
    const int nvec = int(bytes_of(i) / 16);
    for (int v = lane; v < nvec; v += 32) out[v] = in[v];
    __syncwarp();
    refill(i + 1);
  }
}

template <int kUnroll>
void launch_vectors(const CopyProbe& p, cudaStream_t stream) {
  const auto* s = static_cast<const uint8_t*>(p.src);
  auto* d = static_cast<uint8_t*>(p.dst);
  // more than 512 threads: at most 64 registers each
  if (p.threads > 512)
    p.l2_hint ? probe_vectors<kUnroll, true, 1024><<<p.blocks, p.threads, 0, stream>>>(s, d, p.rows, p.row_bytes)
              : probe_vectors<kUnroll, false, 1024><<<p.blocks, p.threads, 0, stream>>>(s, d, p.rows, p.row_bytes);
  else
    p.l2_hint ? probe_vectors<kUnroll, true, 512><<<p.blocks, p.threads, 0, stream>>>(s, d, p.rows, p.row_bytes)
              : probe_vectors<kUnroll, false, 512><<<p.blocks, p.threads, 0, stream>>>(s, d, p.rows, p.row_bytes);
}

}  // namespace

void launch_copy_probe(const char* kind, const CopyProbe& p, cudaStream_t stream) {
  if (p.row_bytes <= 0 || p.row_bytes % 16 != 0 || reinterpret_cast<uintptr_t>(p.src) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(p.dst) % 16 != 0)
    throw std::invalid_argument("copy_probe: row_bytes and both buffers must be multiples of 16 bytes");
  if (std::strcmp(kind, "memcpy") == 0) {
    DC_CUDA_CHECK(cudaMemcpyAsync(p.dst, p.src, size_t(p.rows * p.row_bytes), cudaMemcpyDeviceToDevice, stream));
    return;
  }
  if (p.blocks < 1) throw std::invalid_argument("copy_probe: blocks must be >= 1");
  if (std::strcmp(kind, "vectors") == 0) {
    if (p.threads % 32 != 0 || p.threads < 32 || p.threads > 1024)
      throw std::invalid_argument("copy_probe: threads must be a multiple of 32 in [32, 1024]");
    switch (p.unroll) {
      case 4: launch_vectors<4>(p, stream); break;
      case 8: launch_vectors<8>(p, stream); break;
      case 16: launch_vectors<16>(p, stream); break;
      default: throw std::invalid_argument("copy_probe: unroll must be 4, 8 or 16");
    }
  } else if (std::strcmp(kind, "bulk") == 0 || std::strcmp(kind, "ring") == 0) {
    // bulk stores wait for the second newest group's reads: at least two slots; the ring reads its slot itself
    const bool ring = kind[0] == 'r';
    const int chunk = p.chunk > 0 ? p.chunk : int(p.row_bytes), min_slots = ring ? 1 : 2;
    if (chunk % 16 != 0 || p.slots < min_slots || p.producers < 1 || p.producers > 32 ||
        p.producers * p.slots > kProbeMaxBars)
      throw std::invalid_argument(std::string("copy_probe: ") + kind + " needs chunk % 16 == 0, slots >= " +
                                  std::to_string(min_slots) + ", producers in [1, 32] and producers * slots <= " +
                                  std::to_string(kProbeMaxBars));
    const int smem = p.producers * p.slots * chunk;
    const auto* s = static_cast<const uint8_t*>(p.src);
    auto* d = static_cast<uint8_t*>(p.dst);
    if (ring) {
      opt_in_dynamic_smem<probe_ring>(smem);
      probe_ring<<<p.blocks, 32 * p.producers, smem, stream>>>(s, d, p.rows, p.row_bytes, p.slots, chunk,
                                                               p.lane0_waits);
    } else {
      opt_in_dynamic_smem<probe_bulk>(smem);
      probe_bulk<<<p.blocks, 32 * p.producers, smem, stream>>>(s, d, p.rows, p.row_bytes, p.slots, chunk);
    }
  } else {
    throw std::invalid_argument(std::string("copy_probe: kind must be vectors, bulk, ring or memcpy, got ") + kind);
  }
  DC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dc
