// What a fresh dispatch's host must learn from the GPU: the rows this rank receives and the rows per local
// expert, plus the bad-id counts. The notify kernel's last block writes them into pinned, mapped host memory as
// tagged words: each 64-bit word holds 32 bits of the host's number for the call (count_tag) above a 32-bit value
// and is stored whole, so the host takes a word once it carries the call's number and clears the words it read
// (nvl_calls.cpp), and the kernel needs no barrier and no system-scope fence between the values and a flag. No
// device-to-host copy and no stream sync sit on the fresh path.
#pragma once
#include <cstdint>

#include "agree_record.hpp"
#include "host_device.hpp"

namespace dc {

constexpr int kCountsMaxExperts = 1024;  // local experts per rank the record carries (COUNTS_MAX_EXPERTS)

// The 32 bits of a call's number a word carries: never 0, the mark of a word the host has cleared after reading it
// (so a word left from an earlier call never passes for this one's), and different for consecutive numbers.
DC_HD uint32_t count_tag(uint64_t tag) { return uint32_t(tag % 0xffffffffull) + 1u; }
DC_HD uint64_t tagged_count(uint32_t tag32, int32_t value) { return (uint64_t(tag32) << 32) | uint32_t(value); }
DC_HD bool count_has_tag(uint64_t word, uint32_t tag32) { return uint32_t(word >> 32) == tag32; }
DC_HD int32_t count_value(uint64_t word) { return int32_t(uint32_t(word)); }

struct DispatchCounts {
  uint64_t disagree;       // 0, or 1 + the first peer whose call fingerprint differs (nothing was dispatched);
                           // the host waits for this word first
  uint64_t disagree_word;  // the first word that differs
  uint64_t num_recv;       // rows arriving at this rank, all sources
  uint64_t bad_all;        // expert ids outside [-1, E) on all ranks
  uint64_t bad_mine;       // ... on this rank
  uint64_t num_local_experts;
  uint64_t per_expert[kCountsMaxExperts];  // tokens per local expert, summed over sources, not aligned
  // every rank's words (agree_record.hpp) where `disagree` is not 0: written before it, behind a system-scope fence
  int32_t agree_rows[kAgreeRecordRanks][kFingerprintWords];
};

}  // namespace dc
