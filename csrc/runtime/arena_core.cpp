#include "arena_core.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace dc {

namespace {

// The owner of one reserved range: the views' contexts share it; the last one gives the range back.
struct RangeOwner {
  RangeOwner(std::shared_ptr<ArenaCore::State> s, int64_t o, int64_t n) : state(std::move(s)), offset(o), size(n) {}
  RangeOwner(const RangeOwner&) = delete;
  RangeOwner& operator=(const RangeOwner&) = delete;
  ~RangeOwner() { state->give_back(offset, size); }
  std::shared_ptr<ArenaCore::State> state;
  int64_t offset, size;
};

struct ViewCtx {
  dlpack::ManagedTensor managed;
  int64_t shape[4];
  int64_t strides[4];
  std::shared_ptr<RangeOwner> owner;  // null for a range that is not the free list's
};

void delete_view(dlpack::ManagedTensor* m) { delete static_cast<ViewCtx*>(m->manager_ctx); }

}  // namespace

void ArenaCore::State::give_back(int64_t offset, int64_t size) {
  std::lock_guard<std::mutex> lock(mu);
  released.emplace_back(offset, size);
  releases.fetch_add(1, std::memory_order_release);
}

ArenaCore::ArenaCore(uintptr_t base, int64_t nbytes, int64_t align, dlpack::Device device)
    : base_(base), nbytes_(nbytes), align_(align), device_(device), state_(std::make_shared<State>()) {
  if (nbytes < 0 || align < 1) throw std::invalid_argument("ArenaCore: nbytes must be >= 0 and align >= 1");
  if (nbytes > 0) free_.emplace_back(0, nbytes);
}

int64_t ArenaCore::round(int64_t n) const { return std::max(align_, (n + align_ - 1) / align_ * align_); }

void ArenaCore::drain() {
  std::vector<Range> got;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    got.swap(state_->released);
  }
  for (const auto& r : got) insert(r.first, r.second);
}

void ArenaCore::insert(int64_t offset, int64_t size) {
  auto it = std::lower_bound(free_.begin(), free_.end(), Range{offset, size});
  it = free_.insert(it, Range{offset, size});
  auto next = it + 1;  // merge with the right neighbour, then the left one
  if (next != free_.end() && offset + size == next->first) {
    it->second += next->second;
    free_.erase(next);
  }
  if (it != free_.begin()) {
    auto prev = it - 1;
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      free_.erase(it);
    }
  }
}

std::optional<ArenaCore::Range> ArenaCore::reserve(int64_t nbytes) {
  drain();
  const int64_t size = round(nbytes);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < size) continue;
    const int64_t off = it->first;
    if (it->second == size) {
      free_.erase(it);
    } else {
      it->first += size;
      it->second -= size;
    }
    return Range{off, size};
  }
  return std::nullopt;
}

ArenaCore::Range ArenaCore::trim(int64_t offset, int64_t size, int64_t used) {
  const int64_t keep = round(used);
  if (keep < size) {
    insert(offset + keep, size - keep);
    return {offset, keep};
  }
  return {offset, size};
}

void ArenaCore::release(int64_t offset, int64_t size) { state_->give_back(offset, size); }

int64_t ArenaCore::free_bytes() {
  drain();
  int64_t n = 0;
  for (const auto& r : free_) n += r.second;
  return n;
}

int64_t checked_view_bytes(const ArenaViewSpec& s, int64_t range_bytes, const char* who) {
  if (s.ndim < 1 || s.ndim > 4 || s.dtype.bits % 8 != 0 || s.dtype.bits == 0)
    throw std::invalid_argument(std::string(who) + ": a view has 1 to 4 dims and whole-byte elements");
  int64_t elems = 1;
  for (int d = 0; d < s.ndim; ++d) {
    if (s.shape[d] < 0) throw std::invalid_argument(std::string(who) + ": negative extent");
    elems *= s.shape[d];
  }
  const int64_t bytes = elems * (s.dtype.bits / 8);
  if (s.offset < 0 || s.offset + bytes > range_bytes)
    throw std::out_of_range(std::string(who) + ": view at " + std::to_string(s.offset) + " of " +
                            std::to_string(bytes) + " bytes outside the range of " + std::to_string(range_bytes));
  return bytes;
}

void describe_view(dlpack::Tensor& t, const ArenaViewSpec& s, void* data, dlpack::Device device, int64_t* shape,
                   int64_t* strides) {
  int64_t stride = 1;
  for (int d = s.ndim - 1; d >= 0; --d) {
    shape[d] = s.shape[d];
    strides[d] = stride;
    stride *= std::max<int64_t>(s.shape[d], 1);
  }
  t.data = data;
  t.device = device;
  t.ndim = s.ndim;
  t.dtype = s.dtype;
  t.shape = shape;
  t.strides = strides;
  t.byte_offset = 0;
}

std::vector<dlpack::ManagedTensor*> ArenaCore::views(int64_t offset, int64_t size, bool owned,
                                                     const std::vector<ArenaViewSpec>& specs) const {
  if (offset < 0 || size < 0 || (owned && offset + size > nbytes_))
    throw std::out_of_range("ArenaCore.views: range outside the arena");
  // all checked before any view exists: a throw leaves the range reserved
  for (const ArenaViewSpec& s : specs) checked_view_bytes(s, size, "ArenaCore.views");
  std::shared_ptr<RangeOwner> owner;
  if (owned) owner = std::make_shared<RangeOwner>(state_, offset, size);
  std::vector<dlpack::ManagedTensor*> out;
  out.reserve(specs.size());
  for (const ArenaViewSpec& s : specs) {
    auto* ctx = new ViewCtx{};
    ctx->owner = owner;
    describe_view(ctx->managed.dl_tensor, s, reinterpret_cast<void*>(base_ + uintptr_t(offset + s.offset)), device_,
                  ctx->shape, ctx->strides);
    ctx->managed.manager_ctx = ctx;
    ctx->managed.deleter = delete_view;
    out.push_back(&ctx->managed);
  }
  return out;
}

}  // namespace dc
