// The tuning knobs' current values (tuning.hpp): each starts from its environment variable.
#include "tuning.hpp"

#include <atomic>
#include <cstdlib>

namespace dc {

namespace {

int from_env(const char* env, int fallback) { return env != nullptr && *env != '\0' ? std::atoi(env) : fallback; }

std::atomic<int>* knobs() {
  static std::atomic<int> values[kTuneKnobs];
  static const bool read = [] {
    values[kTuneDispatchUnroll].store(from_env(std::getenv("DEEPCOMM_DISPATCH_UNROLL"), 16));
    values[kTuneDispatchPrefetch].store(from_env(std::getenv("DEEPCOMM_DISPATCH_PREFETCH"), 1));
    values[kTuneCombineConfig].store(from_env(std::getenv("DEEPCOMM_COMBINE_CONFIG"), 0));
    values[kTuneDispatchFused].store(from_env(std::getenv("DEEPCOMM_DISPATCH_FUSED"), 0));
    return true;
  }();
  (void)read;
  return values;
}

}  // namespace

int tuning(TuningKnob knob) { return knobs()[knob].load(std::memory_order_relaxed); }

void set_tuning(TuningKnob knob, int value) { knobs()[knob].store(value, std::memory_order_relaxed); }

}  // namespace dc
