// The NVLink buffer's offsets (runtime/nvl_layout.hpp) as the dict Python reads: nvl_layout() and
// NvlContext.layout() return the same.
#pragma once
#include <pybind11/pybind11.h>

#include "../runtime/nvl_layout.hpp"

namespace dc::bindings {

inline pybind11::dict layout_dict(const NvlLayout& l) {
  pybind11::dict d;
  d["seq_counter"] = l.seq_counter; d["notify_work"] = l.notify_work; d["notify_counts"] = l.notify_counts;
  d["notify_flag"] = l.notify_flag; d["mailbox"] = l.mailbox;
  d["dispatch_done"] = l.dispatch_done; d["combine_ready"] = l.combine_ready; d["combine_flag"] = l.combine_flag;
  d["combine_stage"] = l.combine_stage; d["arena"] = l.arena; d["total"] = l.total; d["agree"] = l.agree;
  d["signal_bytes"] = l.signal_bytes();
  return d;
}

}  // namespace dc::bindings
