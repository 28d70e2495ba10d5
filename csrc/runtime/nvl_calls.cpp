#include "nvl_calls.hpp"

#include <chrono>
#include <thread>

#include "cuda_check.hpp"

namespace dc {

void StreamOrder::begin() const {
  if (previous != nullptr) DC_CUDA_CHECK(cudaStreamWaitEvent(comm, previous, 0));
  if (wait_caller) {
    DC_CUDA_CHECK(cudaEventRecord(start, caller));
    DC_CUDA_CHECK(cudaStreamWaitEvent(comm, start, 0));
  }
}

void StreamOrder::finish() const {
  if (end == nullptr) return;  // the call ran on the caller's stream itself: nothing to join
  DC_CUDA_CHECK(cudaEventRecord(end, comm));
  if (caller_waits) DC_CUDA_CHECK(cudaStreamWaitEvent(caller, end, 0));
}

namespace {

// Poll one of the counts' tagged words until it carries the call's number (dispatch_counts.hpp). Stops early when a
// kernel recorded an error (a device wait timed out: the host then reports that record), else at `deadline`.
bool wait_for_word(const NvlContext& c, const uint64_t* word, uint32_t tag,
                   std::chrono::steady_clock::time_point deadline) {
  for (uint32_t spin = 0;; ++spin) {
    if (count_has_tag(__atomic_load_n(word, __ATOMIC_ACQUIRE), tag)) return true;
    if ((spin & 255u) == 255u) {
      if (__atomic_load_n(&c.err_host->flag, __ATOMIC_ACQUIRE) != 0) return false;
      if (std::chrono::steady_clock::now() > deadline) return false;
      if (spin > 4096) std::this_thread::yield();  // a long wait (a slow peer): leave the core to others
    }
  }
}

// A tagged word's value once it carries the call's number (the kernel stored the word that is waited for first,
// `disagree`, after these, though not behind a fence: they may still be on their way), then the word cleared, so
// that it never passes for a later call's. False where it never came.
bool take_word(const NvlContext& c, uint64_t* word, uint32_t tag, std::chrono::steady_clock::time_point deadline,
               int32_t& value) {
  if (!wait_for_word(c, word, tag, deadline)) return false;
  value = count_value(*word);
  *word = 0;
  return true;
}

void fill_layout(NvlDispatchResult& r, const DispatchArgs& d) {
  const DispatchOutLayout o(r.num_recv, d.x_row_bytes, d.scale_row_bytes, d.topk);
  const int64_t v[6] = {o.x, o.scales, o.topk_idx, o.topk_weights, o.src_idx, o.total};
  for (int i = 0; i < 6; ++i) r.out[i] = v[i];
}

}  // namespace

NvlDispatchResult nvl_dispatch(const NvlContext& c, const StreamOrder& order, const NvlDispatchCall& call) {
  NvlDispatchResult r;
  if (call.begin) order.begin();
  host_stamp(c.host_stamps, kStampBegun);
  DC_HOST_ASSERT(!call.notify || !call.wait || (c.counts_host != nullptr && call.notify_args.host_counts != nullptr),
                 "dispatch: a wait needs the mapped counts");
  DC_HOST_ASSERT(!call.bump || (call.payload && !call.notify), "dispatch: only a cached payload advances the call");
  // notify and payload in one launch where that is chosen (DEEPCOMM_DISPATCH_FUSED=1) and the kernels allow it,
  // else notify, then the payload behind it
  const bool fused = call.notify && call.payload &&
                     launch_dispatch_fused(call.notify_args, call.dispatch, call.num_blocks, c.layout, c.peers,
                                           c.wait_ctx(), order.comm);
  if (call.notify && !fused) launch_notify_dispatch(call.notify_args, c.layout, c.peers, c.wait_ctx(), order.comm);
  host_stamp(c.host_stamps, kStampNotify);
  if (call.payload && !fused) {
    DispatchArgs d = call.dispatch;
    d.advance_seq = call.bump;  // a fresh dispatch's notify advanced it already
    d.after_notify = call.notify;
    launch_dispatch(d, call.num_blocks, c.layout, c.peers, c.wait_ctx(), order.comm);
  }
  host_stamp(c.host_stamps, kStampPayload);
  if (call.dispatch.out_rows >= 0) r.num_recv = int(call.dispatch.out_rows);
  if (call.wait) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto deadline = t0 + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                   std::chrono::duration<double>(call.wait_timeout_s));
    const uint32_t tag = count_tag(call.notify_args.host_tag);
    DispatchCounts& h = *c.counts_host;
    int32_t disagree = 0;
    const bool came = take_word(c, &h.disagree, tag, deadline, disagree);
    r.waited_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    host_stamp(c.host_stamps, kStampWaited);
    if (!came) {
      r.status = 1;
      return r;
    }
    if (disagree != 0) {  // nothing was dispatched on any rank; Python reads the words from the counts, whose
      h.disagree = tagged_count(tag, disagree);  // two words that say so are left as they came
      r.status = wait_for_word(c, &h.disagree_word, tag, deadline) ? 3 : 1;
      if (call.payload && call.finish) order.finish();
      return r;
    }
    int32_t num_recv = 0, local_experts = 0;
    if (!take_word(c, &h.bad_all, tag, deadline, r.bad_all) || !take_word(c, &h.bad_mine, tag, deadline, r.bad_mine) ||
        !take_word(c, &h.num_recv, tag, deadline, num_recv) ||
        !take_word(c, &h.num_local_experts, tag, deadline, local_experts) || local_experts < 0 ||
        local_experts > kCountsMaxExperts) {
      r.status = 1;
      return r;
    }
    if (r.bad_all != 0 || r.bad_mine != 0) {
      r.status = 2;
      if (call.payload && call.finish) order.finish();  // the payload kernel returned at once; keep stream order
      return r;
    }
    if (r.num_recv < 0) r.num_recv = num_recv;
    const int a = call.expert_alignment;
    r.per_expert.resize(size_t(local_experts));
    for (int l = 0; l < local_experts; ++l) {
      int32_t n = 0;
      if (!take_word(c, &h.per_expert[l], tag, deadline, n)) {
        r.status = 1;
        return r;
      }
      r.per_expert[size_t(l)] = (n + a - 1) / a * a;
    }
  }
  if (r.num_recv >= 0) fill_layout(r, call.dispatch);
  if (call.payload && call.finish) order.finish();
  host_stamp(c.host_stamps, kStampDone);
  return r;
}

void nvl_combine(const NvlContext& c, const StreamOrder& order, const CombineArgs& args, int num_blocks) {
  order.begin();
  launch_combine(args, num_blocks, c.layout, c.peers, c.wait_ctx(), order.comm);
  order.finish();
}

}  // namespace dc
