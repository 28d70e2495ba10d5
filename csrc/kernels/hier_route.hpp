// A fresh internode dispatch's route and its count-round row, in one launch and with no host sync: from the
// [T, K] expert ids, every table of runtime/hier_route_layout.hpp (send positions, rdma slots, node masks,
// is_token_in_rank) and the row (the call's words, tokens per rank, per node and per expert, and the count of
// ids outside [-1, E), which count nowhere). deepcomm/internode/hier_route.py has the same tables in torch (the
// oracle the GPU tests compare against, bit for bit) and launches this.
//
// Blocks split the work two ways, each block scanning every token once, in token order (up to 256 ranks and any
// number of experts, with no block waiting for another):
//   rank blocks    one per group of whole nodes of at most 32 ranks: one bit per rank of the group per token, the
//                  send positions (and rdma slots) as block-wide prefix sums over the tokens, tile by tile
//   expert blocks  one per kHierRouteExperts experts: a shared-memory histogram of the ids naming them, a
//                  token's repeated id counted once; the first also counts the bad ids and writes the words
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../runtime/agree_record.hpp"

namespace dc {

constexpr int kHierRouteThreads = 512;
constexpr int kHierRouteTokensPerThread = 4;
constexpr int kHierRouteExperts = 2048;  // experts per expert block (its histogram: 8 KB of shared memory)

struct HierRouteArgs {
  const int64_t* topk_idx;  // [T, K]
  int64_t num_tokens;       // T
  int topk;                 // K
  int64_t num_experts;      // E, a multiple of R
  int ranks;                // R = N x G
  int gpus;                 // G
  bool with_words;          // the row starts with `words`
  Fingerprint words;
  int32_t* work;            // HierRouteWork(T, R, G, E, with_words)
};

void launch_hier_route(const HierRouteArgs& args, cudaStream_t stream);

}  // namespace dc
