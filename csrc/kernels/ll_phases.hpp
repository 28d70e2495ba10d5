// Which halves a low-latency launch runs (exported to Python as deepcomm._C.LL_PHASES).
#pragma once

namespace dc {

// Which halves a launch runs: the send half, the receive half (hook mode launches them apart, so no SM is held
// in between), or both in one kernel (no hook: one launch per call, and a block goes on to receive as soon as the
// data it waits for has landed). kLlWeightsPhase (combine only, with peers reached by puts): just the combine's
// tagged weights, so the host can put them before the send half, which waits for every source's weights.
enum LlPhases : int { kLlSendPhase = 1, kLlRecvPhase = 2, kLlBothPhases = 3, kLlWeightsPhase = 4 };

}  // namespace dc
