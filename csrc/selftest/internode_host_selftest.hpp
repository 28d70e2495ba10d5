// The internode exchange round with CPU threads as posters and as NICs (tests/internode/test_internode_host.py):
// two ranks in host memory, each with a queue pair to the other, run internode_post_round (the GPU kernel's code)
// round after round, each NIC a thread running nic_serve. Synchronous.
#pragma once
#include <cstdint>
#include <vector>

#include "../transport/device_qp_layout.hpp"

namespace dc {

struct InternodeHostRank {
  int64_t mismatched_rounds;          // rounds whose received block differed from what the peer sent
  int64_t rounds_done;                // rounds whose block from the peer arrived
  std::vector<uint64_t> fa_old;       // the last round's credit and signal fetch-add results
  uint64_t credit, signal;            // our counters, raised by the peer's NIC
  transport::QpPosterState poster;
  transport::NicStats nic;
};

struct InternodeHostRun {
  InternodeHostRank rank[2];
  int failed_stage;  // 0, or the WaitStage of the first failed wait
};

// sizes[r][k]: bytes rank r sends in round k + 1 (rank r runs sizes[r].size() rounds: fewer on one rank tests the
// timeouts). Blocks are filled with a pattern of (rank, round, byte) before each round.
InternodeHostRun run_internode_rounds_on_host(const std::vector<std::vector<uint64_t>>& sizes, uint32_t chunk_bytes,
                                              uint32_t log_wqebbs, double timeout_s);

// The byte at offset i of rank r's block in round k (shared with the Python test).
inline uint8_t internode_test_byte(int r, uint64_t k, uint64_t i) {
  return uint8_t((uint64_t(r) * 151u + k * 97u + i * 31u + (i >> 8) * 7u) & 0xffu);
}

}  // namespace dc
