// A warp's stream of payload rows copied by bulk copies through shared memory (its lane 0 issues them): each row
// in chunks of at most kBulkChunkMax bytes, the loads running up to kBulkStages - 1 chunks ahead of the stores,
// across rows, so every warp keeps several chunks in flight without holding them in registers, and one load feeds
// the stores to every rank the row goes to.
#pragma once
#include <cstdint>

#include "../../ptx/bulk.cuh"

namespace dc {

constexpr int kBulkStages = 3;
constexpr int kBulkChunkMax = 4096;

// Chunks per row, and the bytes of every chunk but the last (multiples of 16).
struct BulkChunking {
  int per_row = 1, bytes = 0;
  BulkChunking() = default;
  __host__ __device__ explicit BulkChunking(int64_t row_bytes)
      : per_row(int((row_bytes + kBulkChunkMax - 1) / kBulkChunkMax)),
        bytes(int(((row_bytes + per_row - 1) / per_row + 15) / 16 * 16)) {}
  // a warp's shared memory: kBulkStages chunks
  __host__ __device__ int warp_smem() const { return kBulkStages * bytes; }
};

#if defined(__CUDACC__)
// Lane 0's state. Rows of the stream: row(i) = first + i * step for first + i * step < num_rows.
struct BulkRowPipe {
  uint8_t* slots = nullptr;
  uint64_t* bars = nullptr;
  const uint8_t* src = nullptr;
  int64_t row_bytes = 0;
  BulkChunking ch;
  int64_t first = 0, step = 1;
  int64_t total = 0, issued = 0, stored = 0;  // chunks in the stream, loads issued, chunks stored

  // slots: kBulkStages chunks of this warp's shared memory; bars: kBulkStages barriers. Issues the first loads.
  __device__ void start(uint8_t* slots_, uint64_t* bars_, const void* src_, int64_t row_bytes_, int64_t first_,
                        int64_t step_, int64_t num_rows) {
    slots = slots_, bars = bars_, src = static_cast<const uint8_t*>(src_), row_bytes = row_bytes_;
    ch = BulkChunking(row_bytes_), first = first_, step = step_;
    total = first < num_rows ? ((num_rows - 1 - first) / step + 1) * ch.per_row : 0;
    issued = stored = 0;
    for (int s = 0; s < kBulkStages; ++s) ptx::mbar_init(bars + s, 1);
    ptx::fence_mbar_init();
    while (issued < total && issued < kBulkStages - 1) issue();
  }

  __device__ uint32_t chunk_bytes(int c) const {
    return uint32_t(c + 1 < ch.per_row ? ch.bytes : row_bytes - int64_t(c) * ch.bytes);
  }

  __device__ void issue() {
    const int slot = int(issued % kBulkStages), c = int(issued % ch.per_row);
    const int64_t row = first + (issued / ch.per_row) * step;
    const uint32_t bytes = chunk_bytes(c);
    ptx::mbar_expect_bytes(bars + slot, bytes);
    ptx::bulk_load(slots + int64_t(slot) * ch.bytes, src + row * row_bytes + int64_t(c) * ch.bytes, bytes,
                   bars + slot);
    ++issued;
  }

  // The stream's next row to every dst[d] that is not null (d < num_dst); its slots then load the chunks ahead.
  template <int kMaxDst>
  __device__ void store_row(uint8_t* const* dst, int num_dst) {
    for (int c = 0; c < ch.per_row; ++c) {
      const int slot = int(stored % kBulkStages);
      const uint32_t parity = uint32_t(stored / kBulkStages) & 1u;
      while (!ptx::mbar_try_wait(bars + slot, parity)) {
      }  // our own load from this GPU's memory: it completes
      const uint32_t bytes = chunk_bytes(c);
      const uint8_t* chunk = slots + int64_t(slot) * ch.bytes;
#pragma unroll
      for (int d = 0; d < kMaxDst; ++d)
        if (d < num_dst && dst[d] != nullptr) ptx::bulk_store(dst[d] + int64_t(c) * ch.bytes, chunk, bytes);
      ptx::bulk_commit();
      ++stored;
      if (issued < total) {
        // the slot to refill held the chunk stored one step earlier: the second newest group
        if (issued >= kBulkStages) ptx::bulk_wait_read<1>();
        issue();
      }
    }
  }

  // Every store performed (and ordered before this thread's later release), the barriers retired.
  __device__ void finish() {
    ptx::bulk_wait_all();
    for (int s = 0; s < kBulkStages; ++s) ptx::mbar_inval(bars + s);
  }
};
#endif

}  // namespace dc
