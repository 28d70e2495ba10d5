// Tuning knobs of the normal-mode kernels: which compiled variant a launch picks. A diagnostic for measurement runs:
// each knob starts from its environment variable (read once per process, at the first launch that asks) and
// set_tuning (exported to Python) changes it for the launches that follow, so that one process can time and check
// every variant. The defaults are the measured best; the values are checked where they are used.
#pragma once

namespace dc {

enum TuningKnob : int {
  kTuneDispatchUnroll = 0,    // DEEPCOMM_DISPATCH_UNROLL: 16-byte vectors per lane in flight per pass (16, 8)
  kTuneDispatchPrefetch = 1,  // DEEPCOMM_DISPATCH_PREFETCH: 1 loads a warp's next token's metadata early
  kTuneCombineConfig = 2,     // DEEPCOMM_COMBINE_CONFIG: combine's compiled warp split (combine.cu)
  kTuneDispatchFused = 3,     // DEEPCOMM_DISPATCH_FUSED: 1 runs a fresh dispatch's notify and payload in one launch
                              // (0, the default: two launches; docs/tuning.md has the measured A/B)
  kTuneKnobs = 4,
};

int tuning(TuningKnob knob);
void set_tuning(TuningKnob knob, int value);

}  // namespace dc
