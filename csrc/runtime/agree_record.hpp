// Call agreement on the CUDA kernels (deepcomm/agreement.py defines the 16 words of a call's fingerprint): where
// the words travel and the record a rank leaves when they differ.
//
// Every normal-mode call (fresh dispatch, cached dispatch, combine) and every low-latency call starts by storing
// its words into every peer's AgreeSlot for us, then releasing the slot's tag; the same thread then raises the
// call's own first signal (notify_flag, mailbox, combine_ready; the tagged counts / weights of low-latency mode),
// so the words cost no extra round trip. Each rank waits for every peer's slot and compares the words with its
// own before any row moves; a rank that rejected its own input stores its REJECTED words the same way.
// Normal mode and low-latency mode keep their slots in their own buffers; while a rank waits for a peer's words it
// also looks at the other mode's slots in its own memory (WaitCtx::cross), so a peer that makes a call of the
// other mode with the same call number is met there, and the call stops on the difference instead of timing out.
// On a difference every rank stops the call and writes one AgreeRecord: every rank's words, as it saw them
// (the same on every rank), for the host to word the ValueError (deepcomm/cuda/agree_record.py).
#pragma once
#include <cstdint>

#include "host_device.hpp"

namespace dc {

constexpr int kFingerprintWords = 16;  // agreement.WORDS
constexpr int kAgreeSlotBytes = 128;   // tag u64 | pad | words int32 [16]
constexpr int kAgreeRecordRanks = 8;  // ranks whose words a record carries (one NVLink domain)
// Words the kernels read themselves (agreement.Word), and the first low-latency op (agreement.Op: 1, 2 normal mode,
// 3, 4 low-latency mode)
constexpr int kWordMagic = 0, kWordOp = 1, kWordCall = 2, kWordBuffer = 3;
constexpr int kOpFirstLowLatency = 3;

// A call's words as a kernel argument. w[0] == 0 (no MAGIC): the caller takes no part in agreement (the
// internode backends), and the kernels skip it.
struct Fingerprint {
  int32_t w[kFingerprintWords];
};

// One slot: a peer's words for one call, valid once `tag` (the call's number, release-stored after the words)
// has reached it.
struct AgreeSlot {
  uint64_t tag;
  uint64_t pad;
  int32_t words[kFingerprintWords];
};
static_assert(sizeof(AgreeSlot) <= kAgreeSlotBytes, "AgreeSlot grew");

// Mapped host memory, one per rank (next to the error record). flag: 0 none, 2 being written, 1 complete.
// peer / word: the first peer whose words differ from ours, and the first word index that differs.
struct AgreeRecord {
  int32_t flag;
  int32_t num_ranks;
  int32_t peer;
  int32_t word;
  uint64_t seq;  // the call's device sequence number
  int32_t rows[kAgreeRecordRanks][kFingerprintWords];  // rows[s]: rank s's words
};

}  // namespace dc
