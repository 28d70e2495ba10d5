// A CPU thread that plays the NIC for one send queue: it polls the doorbell record and drains the ring with
// nic_drain (the same code a device-side emulated NIC runs). Every wait is bounded: the thread never sleeps
// longer than a poll slice, so stop() returns promptly, and it gives up with an error when WQEs are pending but
// the consumer leaves the CQ full for longer than the stall timeout.
#pragma once
#include <atomic>
#include <cstdint>
#include <string>
#include <thread>

#include "emulated_nic.hpp"

namespace dc::transport {

enum class WaitResult { kReady, kTimeout, kStopped };

// Wait until the doorbell record announces WQEBBs beyond consumer index ci, for at most timeout_ns
// (spins briefly, then yields and sleeps). `stop`, when given, ends the wait early.
WaitResult wait_doorbell(const uint32_t* dbrec, uint32_t ci, uint64_t timeout_ns,
                         const std::atomic<bool>* stop = nullptr);

struct ProxyOptions {
  uint64_t poll_slice_ns = 1'000'000;         // longest uninterrupted wait for the doorbell
  uint64_t stall_timeout_ns = 5'000'000'000;  // pending WQEs but no free CQE for this long: error
  uint32_t batch = 256;                       // WQEs per nic_drain call
};

class CpuProxy {
 public:
  CpuProxy(const NicQueue& queue, const KeyTable& keys, const ProxyOptions& options = {});
  ~CpuProxy();
  CpuProxy(const CpuProxy&) = delete;
  CpuProxy& operator=(const CpuProxy&) = delete;

  void start();
  void stop();
  bool running() const { return thread_.joinable(); }

  // Block until the proxy has consumed every WQEBB before producer index pi (16-bit compare): kReady; or
  // kTimeout after timeout_ns; or kStopped when the proxy failed or is not running. *why says what went wrong.
  WaitResult wait_consumed(uint32_t pi, uint64_t timeout_ns, std::string* why) const;

  uint32_t consumed() const { return consumed_.load(std::memory_order_acquire); }
  uint64_t wqes_executed() const { return wqes_.load(std::memory_order_acquire); }
  uint8_t queue_error() const { return queue_error_.load(std::memory_order_acquire); }
  std::string failure() const;  // "" while healthy

 private:
  void loop();

  NicQueue queue_;  // touched only by the proxy thread once started
  KeyTable keys_;   // a copy: registrations are fixed while the proxy runs
  ProxyOptions options_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  std::atomic<uint32_t> consumed_{0};
  std::atomic<uint64_t> wqes_{0};
  std::atomic<uint8_t> queue_error_{0};
  std::string failure_;  // written once before failed_ is set
};

}  // namespace dc::transport
