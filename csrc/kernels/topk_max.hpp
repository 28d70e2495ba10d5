// The most top-k slots a token may have on the CUDA kernels (exported to Python as deepcomm._C.TOPK_MAX).
#pragma once

namespace dc {

// One lane of a warp per slot: notify.cu and dispatch.cu load a token's ids into a warp and check topk <= 32.
constexpr int kTopkMax = 32;
static_assert(kTopkMax == 32, "notify.cu and dispatch.cu give each top-k slot one lane of a warp");

}  // namespace dc
