// Zeroed, 64-byte aligned host memory owned by a unique_ptr: the host-memory rings and regions of the CPU twins
// of the GPU transport tests.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

namespace dc::transport {

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};
using HostBytes = std::unique_ptr<uint8_t, FreeDeleter>;

inline HostBytes alloc_zeroed(size_t bytes) {
  bytes = (bytes + 63) / 64 * 64;
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(64, bytes));
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, bytes);
  return HostBytes(p);
}

}  // namespace dc::transport
