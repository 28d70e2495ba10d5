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

// Poll the counts' tag (written last by the notify kernel, with release). Stops early when a kernel recorded an
// error (a device wait timed out: the host then reports that record), else after timeout_s.
bool wait_for_counts(const NvlContext& c, uint64_t tag, double timeout_s) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto limit = std::chrono::duration<double>(timeout_s);
  for (uint32_t spin = 0;; ++spin) {
    if (__atomic_load_n(&c.counts_host->tag, __ATOMIC_ACQUIRE) == tag) return true;
    if ((spin & 255u) == 255u) {
      if (__atomic_load_n(&c.err_host->flag, __ATOMIC_ACQUIRE) != 0) return false;
      if (std::chrono::steady_clock::now() - t0 > limit) return false;
      if (spin > 4096) std::this_thread::yield();  // a long wait (a slow peer): leave the core to others
    }
  }
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
    const bool came = wait_for_counts(c, call.notify_args.host_tag, call.wait_timeout_s);
    r.waited_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    host_stamp(c.host_stamps, kStampWaited);
    if (!came) {
      r.status = 1;
      return r;
    }
    const DispatchCounts& h = *c.counts_host;
    if (h.disagree != 0) {  // nothing was dispatched on any rank; the host reads the words from the counts
      r.status = 3;
      if (call.payload && call.finish) order.finish();
      return r;
    }
    r.bad_all = h.bad_all;
    r.bad_mine = h.bad_mine;
    if (h.bad_all != 0 || h.bad_mine != 0) {
      r.status = 2;
      if (call.payload && call.finish) order.finish();  // the payload kernel returned at once; keep stream order
      return r;
    }
    if (r.num_recv < 0) r.num_recv = h.num_recv;
    const int a = call.expert_alignment;
    r.per_expert.resize(size_t(h.num_local_experts));
    for (int l = 0; l < h.num_local_experts; ++l) r.per_expert[size_t(l)] = (h.per_expert[l] + a - 1) / a * a;
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
