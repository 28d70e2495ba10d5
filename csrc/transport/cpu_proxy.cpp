#include "cpu_proxy.hpp"

#include <chrono>

namespace dc::transport {

namespace {

using Clock = std::chrono::steady_clock;

uint64_t ns_since(Clock::time_point t0) {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}

// Spin first (a doorbell usually follows soon), then yield, then sleep in short steps.
void backoff(uint32_t round) {
  if (round < 64) return;
  if (round < 256) {
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(std::chrono::microseconds(50));
}

}  // namespace

WaitResult wait_doorbell(const uint32_t* dbrec, uint32_t ci, uint64_t timeout_ns, const std::atomic<bool>* stop) {
  const auto t0 = Clock::now();
  for (uint32_t round = 0;; ++round) {
    if (wqebbs_pending(read_producer_index(dbrec), ci) != 0) return WaitResult::kReady;
    if (stop != nullptr && stop->load(std::memory_order_acquire)) return WaitResult::kStopped;
    if (ns_since(t0) >= timeout_ns) return WaitResult::kTimeout;
    backoff(round);
  }
}

CpuProxy::CpuProxy(const NicQueue& queue, const KeyTable& keys, const ProxyOptions& options)
    : queue_(queue), keys_(keys), options_(options) {
  consumed_.store(queue_.ci, std::memory_order_release);
}

CpuProxy::~CpuProxy() { stop(); }

void CpuProxy::start() {
  if (running()) return;
  stop_.store(false, std::memory_order_release);
  thread_ = std::thread([this] { loop(); });
}

void CpuProxy::stop() {
  if (!running()) return;
  stop_.store(true, std::memory_order_release);
  thread_.join();
}

void CpuProxy::loop() {
  bool stalled = false;
  Clock::time_point stall_start;
  while (!stop_.load(std::memory_order_acquire)) {
    const WaitResult w = wait_doorbell(queue_.dbrec, queue_.ci, options_.poll_slice_ns, &stop_);
    if (w != WaitResult::kReady) continue;  // stopped (loop condition) or nothing yet: poll again
    const DrainResult r = nic_drain(queue_, keys_, options_.batch);
    wqes_.fetch_add(r.wqes, std::memory_order_acq_rel);
    queue_error_.store(queue_.error, std::memory_order_release);
    consumed_.store(queue_.ci, std::memory_order_release);
    if (r.status != kDrainCqFull || r.wqes != 0) {
      stalled = false;
      continue;
    }
    if (!stalled) {
      stalled = true;
      stall_start = Clock::now();
    } else if (ns_since(stall_start) > options_.stall_timeout_ns) {
      failure_ = "emulated NIC stalled: WQEs pending at consumer index " + std::to_string(queue_.ci) +
                 " but the completion queue stayed full (nobody polls it)";
      failed_.store(true, std::memory_order_release);
      return;
    }
    backoff(1000);
  }
}

std::string CpuProxy::failure() const {
  return failed_.load(std::memory_order_acquire) ? failure_ : std::string();
}

WaitResult CpuProxy::wait_consumed(uint32_t pi, uint64_t timeout_ns, std::string* why) const {
  const auto t0 = Clock::now();
  for (uint32_t round = 0;; ++round) {
    if (wqebbs_pending(uint16_t(pi), consumed()) == 0) return WaitResult::kReady;
    if (failed_.load(std::memory_order_acquire)) {
      *why = failure_;
      return WaitResult::kStopped;
    }
    if (!running()) {
      *why = "the proxy is not running";
      return WaitResult::kStopped;
    }
    if (ns_since(t0) >= timeout_ns) {
      *why = "timed out after " + std::to_string(timeout_ns / 1000000) + " ms waiting for the emulated NIC: " +
             "consumer index " + std::to_string(consumed() & 0xffffu) + ", doorbell record " +
             std::to_string(read_producer_index(queue_.dbrec)) + ", wanted " + std::to_string(pi & 0xffffu);
      return WaitResult::kTimeout;
    }
    backoff(round);
  }
}

}  // namespace dc::transport
