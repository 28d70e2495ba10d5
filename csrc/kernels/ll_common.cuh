// Pieces the four low-latency kernels share: the per-call sequence number, the ordered rank of each entry among
// its expert's entries, the packed-row bases of the local experts, and warp-wide "which ranks does this token go to".
#pragma once
#include <climits>
#include <cstdint>

#include "../../ptx/ptx.cuh"
#include "../runtime/ll_layout.hpp"
#include "../runtime/rank_set.hpp"
#include "../runtime/wait.cuh"
#include "agree.cuh"
#include "ll_phases.hpp"
#include "ll_trace_points.hpp"

namespace dc {

constexpr int kLlThreads = 256;
static_assert(kLlMaxRanks <= kLlThreads, "the agreement and the per-rank waits take one thread per rank");
constexpr int kLlWarps = kLlThreads / 32;

// The live ranks of a call (every rank but the masked ones), the same in every thread. `all`: no rank is masked,
// the usual case, where a look needs no word of the set (the checks run once per expert id).
struct LlRanks {
  RankSet<kLlMaxRanks> set;
  bool all;
  __device__ __forceinline__ bool has(int r) const { return all || set.has(r); }
  __device__ __forceinline__ LlRanks without(int r) const { return LlRanks{set.without(r), false}; }
};

__device__ __forceinline__ bool ll_is_alive(const LlRanks& alive, int r) { return alive.has(r); }

// Diagnostics: kLlTracePoints and the numbered points (ll_trace_points.hpp).
__device__ __forceinline__ void ll_trace(uint64_t* trace, int point) {
  if (trace != nullptr && threadIdx.x == 0) trace[blockIdx.x * kLlTracePoints + point] = ptx::globaltimer_ns();
}

// Which halves a launch runs: enum LlPhases (ll_phases.hpp, plain C++ so that the bindings can export it).

// First thing in every low-latency kernel. Launched with programmatic dependent launch (LlContext::pdl), a kernel
// can be resident before the kernel ahead of it in the stream ends: it waits here for that kernel to complete (its
// call numbers, rows and buffers included; a no-op without PDL). With pdl == 1 it then lets the next PDL launch
// put its blocks on the SMs while this one runs: every block of this one is resident by then, so none it waits on
// is kept out by the next kernel's.
__device__ __forceinline__ void ll_gate(int pdl) {
  ptx::grid_dependency_wait();
  if (pdl == 1) ptx::launch_dependents();
}

// What every launch reads at entry, before its own send half can finish (that send's last block advances the
// call numbers): the call's sequence number (into ctx.seq), the slot's send count every rank must reach before the
// receive half runs (returned), and the live ranks (bit r: rank r is not masked, ll_layout.hpp "mask"; we are
// always alive). A send's call number is one more than the last one of its kind; a receive's is the one its slot's
// send used (sends of the other slot, or of the other kind, may have run in between). The last block to finish a
// send stores the new numbers (ll_finish_send), so no block reads them early, and CUDA-graph replays advance them
// too. The words are loaded together, lane r taking the mask words of ranks r, 32 + r, ...: one memory round trip
// at entry.
template <bool kSend>
__device__ __forceinline__ uint64_t ll_enter(const uint8_t* self, const LlLayout& l, LlKind kind, int slot,
                                             WaitCtx& ctx, LlRanks* alive) {
  const int lane = threadIdx.x & 31;
  const int* mask = reinterpret_cast<const int*>(self + l.mask);
  constexpr int kWords = RankSet<kLlMaxRanks>::kWords;
  int masked[kWords];
#pragma unroll
  for (int g = 0; g < kWords; ++g)
    masked[g] = 32 * g + lane < l.num_ranks ? ptx::ld_volatile_s32(mask + 32 * g + lane) : 1;
  const uint64_t seq =
      ptx::ld_relaxed_sys_u64(reinterpret_cast<const uint64_t*>(self + (kSend ? l.seq : l.slot_seq)) +
                              (kSend ? kind : kind * 2 + slot));
  const uint64_t calls =
      ptx::ld_relaxed_sys_u64(reinterpret_cast<const uint64_t*>(self + l.slot_calls) + kind * 2 + slot);
#pragma unroll
  bool none_masked = true;  // ranks past num_ranks read as masked
#pragma unroll
  for (int g = 0; g < kWords; ++g) {
    alive->set.w[g] = __ballot_sync(0xffffffffu, masked[g] == 0);
    none_masked = none_masked && (masked[g] == 0 || 32 * g + lane >= l.num_ranks);
  }
  alive->set.add(ctx.rank);
  alive->all = __all_sync(0xffffffffu, none_masked);
  ctx.seq = kSend ? seq + 1 : seq;
  return calls + (kSend ? 1 : 0);
}

// One thread stores `value` at byte `offset` of every live rank's buffer (a word the ranks keep for us there).
__device__ __forceinline__ void ll_store_to_live(const LlPeers& peers, const LlLayout& l, LlRanks alive,
                                                 int64_t offset, uint64_t value) {
  for (int r = 0; r < l.num_ranks; ++r)
    if (ll_is_alive(alive, r)) ptx::st_relaxed_sys_u64(reinterpret_cast<uint64_t*>(peers.at(r) + offset), value);
}

// Every block of a send calls this once, on every path, at its very end; *ok (shared, or null for "always") is 0
// when some warp of the block gave up (a timed-out wait); it is read after the block barrier, once every warp
// has had its say. A block that did not give up tells every live rank that its stores into it are complete: a
// system-scope fence (after the block barrier, so it covers every thread's stores), then one store of the slot's
// new call count `calls` into that rank's arrival word for (us, this block). Each block signals on its own, so the
// receivers see the data of a block as soon as its fence completes, with no count to combine first. Then the block
// counts itself done; the last one advances the call numbers for the next send (local bookkeeping only).
__device__ __forceinline__ void ll_finish_send(uint8_t* self, const LlPeers& peers, const LlLayout& l, LlKind kind,
                                               int slot, uint64_t seq, uint64_t calls, int rank, LlRanks alive,
                                               const int* ok, uint64_t* trace) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  ptx::fence_acq_rel_sys();
  if (ok == nullptr || *ok != 0) ll_store_to_live(peers, l, alive, l.arrival_at(kind, slot, rank, blockIdx.x), calls);
  ll_trace(trace, kLlTraceFinished);
  auto* done = reinterpret_cast<unsigned int*>(self + l.done_count) + kind;
  if (atomicAdd(done, 1u) != gridDim.x - 1) return;
  *done = 0u;
  reinterpret_cast<uint64_t*>(self + l.seq)[kind] = seq;
  reinterpret_cast<uint64_t*>(self + l.slot_seq)[kind * 2 + slot] = seq;
  reinterpret_cast<uint64_t*>(self + l.slot_calls)[kind * 2 + slot] = calls;
  __threadfence();
}

// The receive halves' waits leave warp 0 out: in a fused kernel its thread 0 is still fencing the block's send
// (ll_finish_send returns at once for the other threads), and the polls need not wait for that fence. Waiter w
// (thread 32 + w) takes items w, w + W, w + 2W, ... of a wait; its first two are loaded before either is waited
// on (relaxed count loads overlap; an acquire load of an arrival word may hold the next one back in hardware).
static_assert(kLlThreads > 32, "the receive waits need threads past warp 0");
__device__ __forceinline__ int ll_waiter() { return int(threadIdx.x) - 32; }
__device__ __forceinline__ int ll_waiters() { return int(blockDim.x) - 32; }

// The whole block waits until every block of every live rank has completed its send number `calls` of this kind
// into `slot` (every rank launches the same number of blocks). False for every thread after a timeout.
__device__ __forceinline__ bool ll_wait_arrivals(const uint8_t* self, const LlLayout& l, LlKind kind, int slot,
                                                 uint64_t calls, LlRanks alive, const WaitCtx& ctx, int stage) {
  const int G = gridDim.x, words = l.num_ranks * G, w = ll_waiter(), W = ll_waiters();
  auto word = [&](int i) { return reinterpret_cast<const uint64_t*>(self + l.arrival_at(kind, slot, i / G, i % G)); };
  auto needed = [&](int i) { return w >= 0 && i < words && ll_is_alive(alive, i / G); };
  const bool n0 = needed(w), n1 = needed(w + W);
  const uint64_t v0 = n0 ? ptx::ld_acquire_sys_u64(word(w)) : calls;
  const uint64_t v1 = n1 ? ptx::ld_acquire_sys_u64(word(w + W)) : calls;
  bool good = (v0 >= calls || wait_flag_geq(word(w), calls, ctx, w / G, stage)) &&
              (v1 >= calls || wait_flag_geq(word(w + W), calls, ctx, (w + W) / G, stage));
  for (int i = w + 2 * W; w >= 0 && i < words && good; i += W)
    if (ll_is_alive(alive, i / G)) good = wait_flag_geq(word(i), calls, ctx, i / G, stage);
  return __syncthreads_and(good) != 0;
}

// Call agreement in low-latency mode (agree.cuh) through the agree slots. Off for a buffer with peers reached by
// puts: its agree slots are outside the blocks the host puts; the words travel inside them instead
// (ll_inbox_agree_on, below).
__device__ __forceinline__ bool ll_agree_on(const Fingerprint& f, const LlLayout& l) {
  return agree_on(f) && !l.with_outbox;
}

// Threads 0..R-1 of one block: our words into every live rank's slot for us (kind, slot), tagged `tag`.
__device__ __forceinline__ void ll_agree_publish(const LlPeers& peers, const LlLayout& l, LlRanks alive, LlKind kind,
                                                 int slot, int rank, const Fingerprint& f, uint64_t tag) {
  const int d = threadIdx.x;
  if (d < l.num_ranks && ll_is_alive(alive, d))
    agree_publish(peers.at(d) + l.agree_at(kind, slot) + int64_t(rank) * kAgreeSlotBytes, f, tag);
}

// The whole block: every live rank's words for (kind, slot) carry `tag` and equal ours; false otherwise (after a
// difference, recorded once per rank: agree_report) and after a timed-out wait.
__device__ __forceinline__ bool ll_agree(const uint8_t* self, const LlLayout& l, LlRanks alive, LlKind kind,
                                         int slot, const Fingerprint& f, uint64_t tag, const WaitCtx& ctx) {
  return agree_block<kLlMaxRanks>(self + l.agree_at(kind, slot), f, tag, l.num_ranks, alive, ctx, kStageAgree, true)
             .status == 1;
}

// v[0], v[stride], ..., v[(n - 1) * stride] become their exclusive prefix sums; returns the total. One thread.
__device__ __forceinline__ int ll_exclusive_prefix(int* v, int stride, int n) {
  int run = 0;
  for (int i = 0; i < n; ++i) {
    const int c = v[i * stride];
    v[i * stride] = run;
    run += c;
  }
  return run;
}

// One warp ranks the entries [begin, end) (at most 32 past begin per call): each valid entry p (expert >= 0) gets
// run[e] plus the earlier lanes with the same expert (shuffles against all 32: a fixed cost, unlike match_any with
// many distinct values), and run[e] advances past the chunk. run: shared, per expert.
__device__ __forceinline__ void ll_rank_chunk(const int* experts, int begin, int end, int* run, int* rank_out) {
  const int lane = threadIdx.x & 31;
  const int p = begin + lane;
  const int e = p < end ? experts[p] : -1;
  int before = 0, same = 0;
#pragma unroll 8
  for (int j = 0; j < 32; ++j) {
    const int o = __shfl_sync(0xffffffffu, e, j);
    same += o == e;
    before += (o == e) & (j < lane);
  }
  const int prior = e >= 0 ? run[e] : 0;
  __syncwarp();
  if (e >= 0) {
    rank_out[p] = prior + before;
    if (before == 0) run[e] = prior + same;
  }
  __syncwarp();
}

// The whole block gives each valid entry p in [0, n) (expert >= 0) its rank among the earlier entries of the same
// expert, and counts[e] the entries of e. Warp w ranks a contiguous share of the entries, counting into its own
// row wcount[w][E] (ll_rank_chunk); then the rows become per-expert prefixes over the warps and each entry adds its
// warp's prefix. wcount: kLlWarps * E ints of shared memory. Ends with __syncthreads.
__device__ __forceinline__ void ll_rank_entries(const int* experts, int n, int num_experts, int* rank_in, int* counts,
                                                int* wcount) {
  const int warp = threadIdx.x >> 5;
  for (int i = threadIdx.x; i < kLlWarps * num_experts; i += blockDim.x) wcount[i] = 0;
  __syncthreads();
  const int span = ((n + kLlWarps - 1) / kLlWarps + 31) / 32 * 32;
  const int end = min(n, (warp + 1) * span);
  for (int base = warp * span; base < end; base += 32)
    ll_rank_chunk(experts, base, end, wcount + warp * num_experts, rank_in);
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
    counts[e] = ll_exclusive_prefix(wcount + e, num_experts, kLlWarps);
  __syncthreads();
  for (int p = threadIdx.x; p < n; p += blockDim.x)
    if (experts[p] >= 0) rank_in[p] += wcount[(p / span) * num_experts + experts[p]];
  __syncthreads();
}

// Tagged words (the dispatch's counts and token counts, tagged with the slot's send count; the combine's weights,
// with the combine's sequence number): the low 32 bits of the call's number above a 32-bit value, stored in one
// 8-byte store, so a reader that sees this call's tag sees the value, with no fence or flag.
__device__ __forceinline__ uint64_t ll_tagged(uint64_t calls, int value) {
  return uint64_t(uint32_t(calls)) << 32 | uint32_t(value);
}
__device__ __forceinline__ const uint64_t* ll_count_word(const uint8_t* self, const LlLayout& l, int slot, int s,
                                                         int e) {
  return reinterpret_cast<const uint64_t*>(self + l.counts_at(slot, s)) + e;
}
__device__ __forceinline__ const uint64_t* ll_ntok_word(const uint8_t* self, const LlLayout& l, int slot, int s) {
  return reinterpret_cast<const uint64_t*>(self + l.ntok_at(slot, s));
}

// Entries rank s sends to expert e in `slot`, as it wrote them (E tagged words in its inbox block here), read once
// the arrival words (or the tags) say this call's are there; 0 for masked ranks (their area may hold anything).
__device__ __forceinline__ int ll_count(const uint8_t* self, const LlLayout& l, int slot, LlRanks alive, int s,
                                        int e) {
  return ll_is_alive(alive, s) ? int(uint32_t(ptx::ld_relaxed_sys_u64(ll_count_word(self, l, slot, s, e)))) : 0;
}

// Tokens source s dispatched in `slot`, 0 for a source not in `sources` (a rank set); read like ll_count.
__device__ __forceinline__ int ll_ntok(const uint8_t* self, const LlLayout& l, int slot, LlRanks sources, int s) {
  return ll_is_alive(sources, s) ? int(uint32_t(ptx::ld_relaxed_sys_u64(ll_ntok_word(self, l, slot, s)))) : 0;
}

// The value of tagged word w once it carries the tag of call number `calls`; v: a first load of it, already made
// (so a thread's first loads go out together). After a timeout: *good = false, and the value is meaningless.
__device__ __forceinline__ int ll_tagged_value(const uint64_t* w, uint64_t v, uint64_t calls, const WaitCtx& ctx,
                                               int peer, int stage, bool* good) {
  const uint32_t tag = uint32_t(calls);
  if (uint32_t(v >> 32) != tag &&
      !wait_until([&] { return uint32_t((v = ptx::ld_relaxed_sys_u64(w)) >> 32) == tag; }, ctx, peer, stage))
    *good = false;
  return int(uint32_t(v));
}

// Call agreement for a buffer with peers reached by puts: each rank's words go into every live rank's inbox block
// for it (ll_layout.hpp, agree_dispatch / agree_combine), inside the data the host puts, as tagged words (the low
// 32 bits of the call's tag above each word), so a word that shows the tag holds its value whatever order a put
// lands in. A dispatch's words come with its data and are compared once the arrival words are in; a combine's come
// with its weights, put ahead of the send half, and are compared before any partial leaves (in the send half and
// again in the receive half, which then stops before it waits for arrivals that never come).
__device__ __forceinline__ bool ll_inbox_agree_on(const Fingerprint& f, const LlLayout& l) {
  return agree_on(f) && l.with_outbox;
}

// Threads 0..R-1 of one block: our words of `kind`, tagged `tag`, into every live rank's inbox block for us (through
// peers.at: a put peer's land in our outbox block for it).
__device__ __forceinline__ void ll_inbox_publish(const LlPeers& peers, const LlLayout& l, LlRanks alive, LlKind kind,
                                                 int slot, int rank, const Fingerprint& f, uint64_t tag) {
  const int d = threadIdx.x;
  if (d >= l.num_ranks || !ll_is_alive(alive, d)) return;
  auto* words = reinterpret_cast<uint64_t*>(peers.at(d) + l.inbox_agree_at(kind, slot, rank));
#pragma unroll
  for (int i = 0; i < kFingerprintWords; ++i) ptx::st_relaxed_sys_u64(words + i, ll_tagged(tag, f.w[i]));
}

// The whole block: every live rank's tagged words of `kind` in our inbox blocks for `slot` equal ours. `poll`: wait
// (bounded) for each word to carry `tag`; else they must carry it already (read after the arrival words), and one
// that does not counts as a difference. A difference is recorded once per rank (agree_report_rows) and, like a
// timed-out wait, gives false; the same result for every thread; ends with __syncthreads.
__device__ __forceinline__ bool ll_inbox_agree(const uint8_t* self, const LlLayout& l, LlRanks alive, LlKind kind,
                                               int slot, const Fingerprint& f, uint64_t tag, const WaitCtx& ctx,
                                               bool poll) {
  __shared__ uint32_t differs[kLlMaxRanks];  // per rank, bit i: word i differs from ours (or lacks the tag)
  __shared__ int timed_out;
  const int R = l.num_ranks, s = threadIdx.x;
  auto word = [&](int r, int i) {
    return reinterpret_cast<const uint64_t*>(self + l.inbox_agree_at(kind, slot, r)) + i;
  };
  if (s == 0) timed_out = 0;
  if (s < kLlMaxRanks) differs[s] = 0u;
  __syncthreads();
  if (s < R && ll_is_alive(alive, s)) {
    uint32_t bits = 0u;
    bool good = true;
    for (int i = 0; i < kFingerprintWords && good; ++i) {
      uint64_t v = ptx::ld_relaxed_sys_u64(word(s, i));
      if (poll) {
        const int value = ll_tagged_value(word(s, i), v, tag, ctx, s, kStageAgree, &good);
        if (good && value != f.w[i]) bits |= 1u << i;
      } else if (uint32_t(v >> 32) != uint32_t(tag) || int(uint32_t(v)) != f.w[i]) {
        bits |= 1u << i;
      }
    }
    if (!good) timed_out = 1;
    differs[s] = bits;
  }
  __syncthreads();
  __shared__ int diff_peer;
  if (s == 0) {
    diff_peer = -1;
    for (int p = 0; p < R && !timed_out; ++p) {
      if (differs[p] == 0u) continue;
      diff_peer = p;
      agree_report_rows(ctx.agree, R, p, __ffs(int(differs[p])) - 1, ctx, [&](int32_t (*rows)[kFingerprintWords]) {
        for (int r = 0; r < R && r < kAgreeRecordRanks; ++r)
          for (int i = 0; i < kFingerprintWords; ++i)
            rows[r][i] = ll_is_alive(alive, r) ? int(uint32_t(ptx::ld_relaxed_sys_u64(word(r, i)))) : 0;
      });
      break;
    }
  }
  __syncthreads();
  const bool agreed = !timed_out && diff_peer < 0;
  __syncthreads();  // the shared words may be reused by a later call
  return agreed;
}

// Packed rows of our local experts: rows of local expert le coming from rank s start at base[le * R + s];
// total[le] rows in all, from the counts as the senders wrote them; and n[s] = the token count of every rank.
// Both are polled until they carry the tag of send count `calls`: block 0 of each source stores them first, with
// no fence, so the bases are known before the rows' arrival words come in (warp 0 left out, ll_waiter; a thread's
// first loads go out together). Whole block; false for every thread after a timeout; ends with __syncthreads.
__device__ __forceinline__ bool ll_expert_bases(const uint8_t* self, const LlLayout& l, int slot, int rank,
                                                LlRanks alive, uint64_t calls, const WaitCtx& ctx, int stage,
                                                int* base, int* total, int* n) {
  const int R = l.num_ranks, L = l.local_experts(), w = ll_waiter(), W = ll_waiters();
  auto word = [&](int i) { return ll_count_word(self, l, slot, i % R, rank * L + i / R); };
  auto needed = [&](int i) { return w >= 0 && i < L * R && ll_is_alive(alive, i % R); };
  const bool n0 = needed(w), n1 = needed(w + W), nt = w >= 0 && w < R && ll_is_alive(alive, w);
  const uint64_t* nw = ll_ntok_word(self, l, slot, nt ? w : 0);
  const uint64_t v0 = n0 ? ptx::ld_relaxed_sys_u64(word(w)) : 0, v1 = n1 ? ptx::ld_relaxed_sys_u64(word(w + W)) : 0;
  const uint64_t vn = nt ? ptx::ld_relaxed_sys_u64(nw) : 0;
  bool good = true;
  if (w >= 0 && w < L * R) base[w] = n0 ? ll_tagged_value(word(w), v0, calls, ctx, w % R, stage, &good) : 0;
  if (w >= 0 && w + W < L * R)
    base[w + W] = n1 ? ll_tagged_value(word(w + W), v1, calls, ctx, (w + W) % R, stage, &good) : 0;
  if (w >= 0 && w < R) n[w] = nt ? ll_tagged_value(nw, vn, calls, ctx, w, stage, &good) : 0;
  for (int i = w + 2 * W; w >= 0 && i < L * R; i += W)
    base[i] = needed(i) && good ? ll_tagged_value(word(i), ptx::ld_relaxed_sys_u64(word(i)), calls, ctx, i % R,
                                                  stage, &good)
                                : 0;
  if (!__syncthreads_and(good)) return false;
  for (int le = threadIdx.x; le < L; le += blockDim.x) total[le] = ll_exclusive_prefix(base + le * R, 1, R);
  __syncthreads();
  return true;
}

// The flat item space of the receive halves (and the combine's send): `per_token` items for each token of each
// live source rank, sources ascending. n: [R] tokens per source (0 for masked ranks), read once per block.

// n[s] = ll_ntok(s) for every rank s. Threads 0..R-1; the caller's next barrier publishes it.
__device__ __forceinline__ void ll_load_ntok(const uint8_t* self, const LlLayout& l, int slot, LlRanks sources,
                                             int* n) {
  if (threadIdx.x < l.num_ranks) n[threadIdx.x] = ll_ntok(self, l, slot, sources, threadIdx.x);
}

// Items in all (the dispatch's threads each compute it; the combine's thread 0 stores it for the block).
__device__ __forceinline__ int ll_item_count(const int* n, int R, int per_token) {
  int sum = 0;
  for (int s = 0; s < R; ++s) sum += n[s];
  return sum * per_token;
}

// Which source an item belongs to, and the item's index among that source's items.
__device__ __forceinline__ void ll_item_source(const int* n, int R, int per_token, int item, int* s, int* rest) {
  int k = 0;
  while (k < R - 1 && item >= n[k] * per_token) item -= n[k++] * per_token;
  *s = k;
  *rest = item;
}

// A token's destination ranks, spread over a warp: lane k < K holds the rank of slot k's expert, kLlNoRank for
// none (callers have already dropped experts of masked ranks), the other lanes kLlNoRank. A list of at most K
// ranks rather than a bit per rank, so that its size does not grow with the job.
constexpr int kLlNoRank = INT_MAX;

__device__ __forceinline__ int ll_slot_rank(int expert, int experts_per_rank) {
  return expert >= 0 ? expert / experts_per_rank : kLlNoRank;
}

// Each destination rank of a token once, ranks ascending (the order combine adds the partials in), from a
// destination list: `LlDestWalk walk(list); for (int d; (d = walk.next()) != kLlNoRank;)`. Every lane gets the same
// ranks, so the loop is the same in every lane. The rank after d is taken out before the caller works on d, so its
// warp reduction is under way while the caller's stores go out instead of after them.
class LlDestWalk {
 public:
  __device__ __forceinline__ explicit LlDestWalk(int list) : pending_(list) { next_ = take(); }
  __device__ __forceinline__ int next() {
    const int d = next_;
    if (d != kLlNoRank) next_ = take();
    return d;
  }

 private:
  // the lowest rank still pending in any lane, taken out of every lane that holds it; kLlNoRank once none is left
  __device__ __forceinline__ int take() {
    const int d = __reduce_min_sync(0xffffffffu, pending_);
    if (pending_ == d) pending_ = kLlNoRank;
    return d;
  }
  int pending_, next_;
};

// Whether rank r is among a token's destinations (every lane gets the same answer).
__device__ __forceinline__ bool ll_has_rank(int pending, int r) { return __any_sync(0xffffffffu, pending == r); }

}  // namespace dc
