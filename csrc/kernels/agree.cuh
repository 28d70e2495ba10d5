// Device side of call agreement (csrc/runtime/agree_record.hpp): publish this call's words to every peer, wait
// for theirs, compare, and leave one record when they differ. Used by notify.cu, dispatch.cu (cached dispatch),
// combine.cu, the low-latency kernels and agree_reject.cu.
#pragma once
#include <cstdint>

#include "../../ptx/ptx.cuh"
#include "../runtime/agree_record.hpp"
#include "../runtime/rank_set.hpp"
#include "../runtime/wait.cuh"

namespace dc {

// Ranks agree_block compares unless told more: normal mode's NVLink domain (low-latency mode passes kLlMaxRanks).
constexpr int kAgreeMaxRanks = 32;

__device__ __forceinline__ bool agree_on(const Fingerprint& f) { return f.w[0] != 0; }

// One thread: our words into a peer's slot for us, without its tag (agree_publish, or a caller that stores the
// tag itself after a system-scope fence it needs anyway).
__device__ __forceinline__ uint64_t* agree_store_words(uint8_t* slot, const Fingerprint& f) {
  auto* s = reinterpret_cast<AgreeSlot*>(slot);
#pragma unroll
  for (int i = 0; i < kFingerprintWords; ++i) s->words[i] = f.w[i];
  return &s->tag;
}

// One thread: a system-scope fence, then the tag of the words agree_store_words left (unless null) and the caller's
// first signal to that peer, `flag`, both as relaxed stores the fence releases, with the thread's stores before it
// (a release store each would fence twice before the peer hears of the call).
__device__ __forceinline__ void release_words_and_flag(uint64_t* words_tag, uint64_t* flag, uint64_t value) {
  ptx::fence_acq_rel_sys();
  if (words_tag != nullptr) ptx::st_relaxed_sys_u64(words_tag, value);
  ptx::st_relaxed_sys_u64(flag, value);
}

// One thread: our words into a peer's slot for us, then its tag with release (so a reader that sees the tag sees
// the words). The caller's next release store to that peer (its first signal) follows it.
__device__ __forceinline__ void agree_publish(uint8_t* slot, const Fingerprint& f, uint64_t tag) {
  ptx::st_release_sys_u64(agree_store_words(slot, f), tag);
}

// The other mode's slot (WaitCtx::cross) in which peer s left its words of call f.w[CALL] on this Buffer, or null:
// the peer is then in a call of the other mode (normal against low-latency) with our call's number.
__device__ __forceinline__ const uint8_t* agree_cross_find(const WaitCtx& ctx, const Fingerprint& f, int R, int s) {
  for (int j = 0; j < ctx.cross_sets; ++j) {
    const uint8_t* at = ctx.cross + (int64_t(j) * R + s) * kAgreeSlotBytes;
    const auto* slot = reinterpret_cast<const AgreeSlot*>(at);
    if (ptx::ld_acquire_sys_u64(&slot->tag) == 0) continue;  // never written (the words follow their tag)
    const int32_t op = ptx::ld_volatile_s32(&slot->words[kWordOp]);
    if (ptx::ld_volatile_s32(&slot->words[kWordMagic]) == f.w[kWordMagic] &&
        ptx::ld_volatile_s32(&slot->words[kWordCall]) == f.w[kWordCall] &&
        ptx::ld_volatile_s32(&slot->words[kWordBuffer]) == f.w[kWordBuffer] &&
        (op >= kOpFirstLowLatency) != (f.w[kWordOp] >= kOpFirstLowLatency))
      return at;
  }
  return nullptr;
}

// One thread: wait (bounded) until a peer's slot carries call `tag` or a later one, or until the peer shows up in
// the other mode's slots with our call number (looked at every 16th poll: only a waiting thread pays for it).
// *found: where the peer's words are, its slot or the other mode's.
__device__ __forceinline__ bool agree_wait(const uint8_t* slot, uint64_t tag, const WaitCtx& ctx, int peer,
                                           int stage, const Fingerprint& f, int R, const uint8_t** found) {
  const auto* t = &reinterpret_cast<const AgreeSlot*>(slot)->tag;
  *found = slot;
  if (ctx.cross == nullptr) return wait_flag_geq(t, tag, ctx, peer, stage);
  uint32_t polls = 0;
  return wait_until([&] {
    if (ptx::ld_acquire_sys_u64(t) >= tag) return true;
    if ((++polls & 15u) != 0u) return false;
    const uint8_t* other = agree_cross_find(ctx, f, R, peer);
    if (other == nullptr) return false;
    *found = other;
    return true;
  }, ctx, peer, stage);
}

// One thread, once every peer's words are in: copy every rank's words (rank s's at found[s]; ranks outside `alive`,
// a RankSet or AllRanks, read as zeros) into `rows`.
template <typename Alive>
__device__ __forceinline__ void agree_copy_rows(int32_t (*rows)[kFingerprintWords], const uint8_t* const* found,
                                                int R, const Alive& alive) {
  for (int s = 0; s < R && s < kAgreeRecordRanks; ++s)
    for (int i = 0; i < kFingerprintWords; ++i)
      rows[s][i] = alive.has(s)
                       ? ptx::ld_volatile_s32(&reinterpret_cast<const AgreeSlot*>(found[s])->words[i])
                       : 0;
}

// One thread: the first disagreement of this rank's kernels wins the record; then the error record names it as
// an input error (kStageDisagree), which the host raises as a ValueError at its next look (no host wait here).
// fill(rows): every rank's words into the record's rows.
template <typename Fill>
__device__ __forceinline__ void agree_report_rows(AgreeRecord* rec, int R, int peer, int word, const WaitCtx& ctx,
                                                  Fill fill) {
  if (rec == nullptr) return;
  if (ptx::atom_cas_acquire_gpu_u32(reinterpret_cast<uint32_t*>(&rec->flag), 0u, 2u) != 0u) return;
  rec->num_ranks = R;
  rec->peer = peer;
  rec->word = word;
  rec->seq = ctx.seq;
  fill(rec->rows);
  ptx::fence_acq_rel_sys();
  ptx::st_release_sys_u32(reinterpret_cast<uint32_t*>(&rec->flag), 1u);
  report_input_error(ctx, peer, kStageDisagree);
}

// The same for words in agree slots (rank s's at found[s]).
template <typename Alive>
__device__ __forceinline__ void agree_report(AgreeRecord* rec, const uint8_t* const* found, int R, const Alive& alive,
                                             int peer, int word, const WaitCtx& ctx) {
  agree_report_rows(rec, R, peer, word, ctx,
                    [&](int32_t (*rows)[kFingerprintWords]) { agree_copy_rows(rows, found, R, alive); });
}

// What agree_block found: status 1 every rank agrees, 0 a difference (peer, word: the first), -1 a timed-out wait.
struct AgreeResult {
  int status, peer, word;
};

// The whole block (threads 0..R-1 wait for one peer each): wait for every peer in `alive` to publish call `tag` into
// `slots` (ours, [R] consecutive), or to show up in a call of the other mode with our call number (agree_wait), and
// compare with `f`. On a difference thread 0 of a block with `report` leaves the record (agree_report); with `rows`,
// thread 0 also copies every rank's words there. The same result for every thread; ends with __syncthreads.
// R <= kMaxPeers <= blockDim.x.
template <int kMaxPeers = kAgreeMaxRanks, typename Alive>
__device__ __forceinline__ AgreeResult agree_block(const uint8_t* slots, const Fingerprint& f, uint64_t tag, int R,
                                                   const Alive& alive, const WaitCtx& ctx, int stage, bool report,
                                                   int32_t (*rows)[kFingerprintWords] = nullptr) {
  __shared__ int diff_peer, diff_word, timed_out;
  __shared__ uint32_t differs[kMaxPeers];  // per peer, bit i: word i differs from ours
  __shared__ const uint8_t* found[kMaxPeers];  // per peer: where its words are (its slot, or the other mode's)
  if (threadIdx.x == 0) {
    diff_peer = -1;
    diff_word = -1;
    timed_out = 0;
  }
  for (int p = threadIdx.x; p < kMaxPeers; p += blockDim.x) {
    differs[p] = 0u;
    found[p] = slots + int64_t(p) * kAgreeSlotBytes;
  }
  __syncthreads();
  const int s = threadIdx.x;
  if (s < R && alive.has(s)) {
    const uint8_t* at = nullptr;
    if (!agree_wait(slots + int64_t(s) * kAgreeSlotBytes, tag, ctx, s, stage, f, R, &at)) timed_out = 1;
    found[s] = at;
  }
  __syncthreads();
  // every (peer, word) compared by its own thread: one load each instead of R * 16 in one thread
  if (!timed_out) {
    for (int i = threadIdx.x; i < R * kFingerprintWords; i += blockDim.x) {
      const int p = i / kFingerprintWords, w = i % kFingerprintWords;
      const auto* slot = reinterpret_cast<const AgreeSlot*>(found[p]);
      if (alive.has(p) && ptx::ld_volatile_s32(&slot->words[w]) != f.w[w]) atomicOr(&differs[p], 1u << w);
    }
  }
  __syncthreads();
  // the lowest differing peer and its first differing word (one thread: the same choice on every block)
  if (threadIdx.x == 0 && !timed_out) {
    for (int p = 0; p < R; ++p) {
      if (differs[p] != 0u) {
        diff_peer = p;
        diff_word = __ffs(int(differs[p])) - 1;
        break;
      }
    }
    if (diff_peer >= 0 && report) agree_report(ctx.agree, found, R, alive, diff_peer, diff_word, ctx);
    if (diff_peer >= 0 && rows != nullptr) agree_copy_rows(rows, found, R, alive);
  }
  __syncthreads();
  const AgreeResult r{timed_out ? -1 : diff_peer < 0 ? 1 : 0, diff_peer, diff_word};
  __syncthreads();  // the shared words may be reused by a later agree_block
  return r;
}

}  // namespace dc
