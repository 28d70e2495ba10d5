// A device queue pair layout from sizes a caller passed (the bindings and the self-test module): out-of-range
// sizes throw std::invalid_argument, which pybind11 turns into a Python ValueError.
#pragma once
#include <cstdint>
#include <stdexcept>

#include "device_qp_layout.hpp"

namespace dc::transport {

inline DeviceQpLayout checked_layout(uint32_t log_wqebbs, uint32_t log_cqes) {
  if (log_wqebbs < 2 || log_wqebbs > kMaxLogWqebbs) throw std::invalid_argument("log_wqebbs must be in [2, 15]");
  if (log_cqes > kMaxLogCqes) throw std::invalid_argument("log_cqes must be <= 16");
  return DeviceQpLayout::make(log_wqebbs, log_cqes);
}

}  // namespace dc::transport
