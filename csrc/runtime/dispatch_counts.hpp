// What a fresh dispatch's host must learn from the GPU: the rows this rank receives and the rows per local
// expert, plus the bad-id counts. The notify kernel's last block writes them into pinned, mapped host memory and
// then the tag (the host's number for the call) with release semantics; the host polls the tag (nvl_calls.cpp),
// so no device-to-host copy and no stream sync sit on the fresh path.
#pragma once
#include <cstdint>

#include "agree_record.hpp"

namespace dc {

constexpr int kCountsMaxExperts = 1024;  // local experts per rank the record carries (COUNTS_MAX_EXPERTS)

struct DispatchCounts {
  uint64_t tag;          // written last; 0 = never written
  int32_t num_recv;      // rows arriving at this rank, all sources
  int32_t bad_all;       // expert ids outside [-1, E) on all ranks
  int32_t bad_mine;      // ... on this rank
  int32_t num_local_experts;
  int32_t disagree;      // 0, or 1 + the first peer whose call fingerprint differs (nothing was dispatched)
  int32_t disagree_word; // the first word that differs
  int32_t agree_rows[kAgreeRecordRanks][kFingerprintWords];  // then: every rank's words (agree_record.hpp)
  int32_t per_expert[kCountsMaxExperts];  // tokens per local expert, summed over sources, not aligned
};

}  // namespace dc
