// The dispatch-output arena's bookkeeping (deepcomm/cuda/arena.py holds one per NVLink buffer): a free list of byte
// ranges of one device region, and typed views of a reserved range handed out as DLPack tensors. The views of one
// range share an owner; when the consumer has dropped the last of them (on any thread, with or without the GIL)
// the range is queued, and the next reserve() takes it back. One crossing makes every view of a call, where a
// torch.as_tensor over __cuda_array_interface__ per view cost microseconds each.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "dlpack_abi.hpp"

namespace dc {

// One typed view of a reserved range: byte offset in the range, row-major shape (1 to 4 dims), DLPack type.
struct ArenaViewSpec {
  int64_t offset;
  int ndim;
  int64_t shape[4];
  dlpack::DataType dtype;
};

// The bytes `s` covers, after checking it: 1 to 4 dims of whole-byte elements, no negative extent, inside
// [0, range_bytes). Throws std::invalid_argument / std::out_of_range prefixed with `who`.
int64_t checked_view_bytes(const ArenaViewSpec& s, int64_t range_bytes, const char* who);

// `t` describing the spec's row-major view at `data` on `device`; its extents go into `shape` and `strides` (4 each,
// owned by the caller's view).
void describe_view(dlpack::Tensor& t, const ArenaViewSpec& s, void* data, dlpack::Device device, int64_t* shape,
                   int64_t* strides);

class ArenaCore {
 public:
  using Range = std::pair<int64_t, int64_t>;  // (offset, size)

  ArenaCore(uintptr_t base, int64_t nbytes, int64_t align, dlpack::Device device);

  // A free range of at least nbytes (rounded up to align, at least align), taken from the free list.
  std::optional<Range> reserve(int64_t nbytes);
  // Keep the first `used` bytes (rounded up) of a reserved range, give the rest back now.
  Range trim(int64_t offset, int64_t size, int64_t used);
  // Give back a reserved range that never became views (its launch failed); counted as a release.
  void release(int64_t offset, int64_t size);
  int64_t free_bytes();
  int64_t releases() const { return state_->releases.load(std::memory_order_acquire); }

  // The views of one reserved range: DLPack tensors the caller hands to a consumer, which calls their deleter.
  // owned: the range returns to the free list when the last view is deleted; else (the bounce area past the
  // arena's end) it never does. Every spec must lie inside [offset, offset + size).
  std::vector<dlpack::ManagedTensor*> views(int64_t offset, int64_t size, bool owned,
                                            const std::vector<ArenaViewSpec>& specs) const;

  struct State {  // shared with the views' owners, which may outlive the arena
    std::mutex mu;
    std::vector<Range> released;
    std::atomic<int64_t> releases{0};
    void give_back(int64_t offset, int64_t size);
  };

 private:
  void drain();
  void insert(int64_t offset, int64_t size);
  int64_t round(int64_t n) const;

  uintptr_t base_;
  int64_t nbytes_, align_;
  dlpack::Device device_;
  std::vector<Range> free_;  // sorted by offset, coalesced
  std::shared_ptr<State> state_;
};

}  // namespace dc
