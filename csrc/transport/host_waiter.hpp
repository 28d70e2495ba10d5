// The Waiter of qp_poster.hpp for CPU threads: spin on the condition, yielding the core (CI machines have two),
// give up after timeout_ns or as soon as another thread has failed. The first failure's stage is kept.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

namespace dc::transport {

struct HostWaiter {
  uint64_t timeout_ns;
  std::atomic<int>* failed_stage;  // 0 while nobody failed

  template <typename Done>
  bool wait(Done done, int stage) const {
    const auto t0 = std::chrono::steady_clock::now();
    for (uint32_t spin = 0;; ++spin) {
      if (done()) return true;
      if (failed_stage->load(std::memory_order_acquire) != 0) return false;
      const auto waited = std::chrono::steady_clock::now() - t0;
      if (uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count()) > timeout_ns) {
        fail(stage);
        return false;
      }
      if (spin >= 64) std::this_thread::yield();
    }
  }
  void fail(int stage) const {
    int none = 0;
    failed_stage->compare_exchange_strong(none, stage, std::memory_order_acq_rel);
  }
};

}  // namespace dc::transport
