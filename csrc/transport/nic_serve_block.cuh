// The device emulated NIC run by a whole block, for real payloads. Thread 0 walks the queue exactly as
// nic_drain does (nic_decode_next -> execute -> nic_complete, the same checks and CQEs); the only difference is
// that the payload of a non-inline RDMA write is copied by every thread of the block with 16-byte vectors
// instead of one byte at a time by one thread. Atomics and inline writes stay with thread 0.
//
// A write's copy is made visible at system scope by every copying thread (fence) before the block barrier, so
// a later fetch-add (release, by thread 0) never overtakes the bytes of an earlier write: ordering as on an RC
// queue pair.
//
// The queue's NIC state (consumer index, CQ producer index, error) persists in NicStats across launches, so one
// queue pair serves many kernels; NicTotals accumulate what was executed, for tests and the benchmark.
#pragma once
#include "../runtime/wait.cuh"
#include "device_qp_layout.hpp"
#include "qp_poster.hpp"

namespace dc::transport {

__device__ __forceinline__ void block_copy(uint8_t* dst, const uint8_t* src, uint32_t bytes) {
  const bool aligned = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) & 15u) == 0;
  if (aligned) {
    auto* d = reinterpret_cast<int4*>(dst);
    const auto* s = reinterpret_cast<const int4*>(src);
    const uint32_t n = bytes / 16;
    uint32_t i = threadIdx.x;
    for (; i + 3 * blockDim.x < n; i += 4 * blockDim.x) {  // four loads in flight per thread
      const int4 a = s[i], b = s[i + blockDim.x], c = s[i + 2 * blockDim.x], e = s[i + 3 * blockDim.x];
      d[i] = a; d[i + blockDim.x] = b; d[i + 2 * blockDim.x] = c; d[i + 3 * blockDim.x] = e;
    }
    for (; i < n; i += blockDim.x) d[i] = s[i];
  } else {
    for (uint32_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
  }
}

// Serve `qp` until *stop_word reaches stop_target (free-running u32) and nothing is pending. Every thread of the
// block calls it. Returns false (all threads) on a timeout, recorded by the waiter.
template <typename Waiter>
__device__ bool nic_serve_block(const DeviceQp& qp, const KeyTable& keys, const uint32_t* stop_word,
                                uint32_t stop_target, const Waiter& waiter, NicTotals* totals) {
  enum : int { kStop = 0, kCopy = 1, kDone = 2, kFailed = 3 };
  __shared__ int action;
  __shared__ uint8_t* copy_dst;
  __shared__ const uint8_t* copy_src;
  __shared__ uint32_t copy_bytes;

  NicQueue q;
  NicStep step;
  NicTotals t{0, 0, 0, 0};
  if (threadIdx.x == 0) {
    q = qp.nic_view(qp.nic_stats->consumed);
    q.cq_pi = qp.nic_stats->cqes;
    q.error = uint8_t(qp.nic_stats->error);
  }
  for (;;) {
    if (threadIdx.x == 0) {
      uint16_t pi = 0;
      bool have = false;
      const bool ok = waiter.wait([&] {
        // The stop word first: the doorbells it covers are then visible to the producer-index read after it.
        const bool finished = index_geq(load_acquire_u32(stop_word), stop_target);
        pi = read_producer_index(q.dbrec);
        if (wqebbs_pending(pi, q.ci) != 0) return have = cq_room(q.cq, q.cq_pi) != 0;
        return finished;
      }, kStageNicDoorbell);
      int a = !ok ? kFailed : (have ? kDone : kStop);
      if (have) {
        step = nic_decode_next(q, pi);
        const DecodedWqe& w = step.w;
        uint8_t syndrome = step.syndrome;
        if (syndrome == kSyndromeNone && !w.is_inline && w.opcode != kOpAtomicFetchAdd) {
          uint8_t* dst;
          const uint8_t* src;
          syndrome = nic_translate_write(w, keys, &dst, &src);
          if (syndrome == kSyndromeNone) {
            copy_dst = dst;
            copy_src = src;
            copy_bytes = w.bytes;
            a = kCopy;
          }
        } else if (syndrome == kSyndromeNone) {
          syndrome = nic_execute(q.sq, w, keys);
        }
        if (a == kDone) {
          nic_complete(q, step, syndrome);
          ++t.wqes;
          if (syndrome == kSyndromeNone) {
            t.bytes += w.opcode == kOpAtomicFetchAdd ? 8 : w.bytes;
            (w.opcode == kOpAtomicFetchAdd ? t.atomics : t.writes) += 1;
          }
        }
      }
      action = a;
    }
    __syncthreads();
    const int a = action;
    if (a == kStop || a == kFailed) break;
    if (a == kCopy) {
      block_copy(copy_dst, copy_src, copy_bytes);
      __threadfence_system();
    }
    __syncthreads();  // the copy is complete and `action` may be rewritten
    if (threadIdx.x == 0 && a == kCopy) {
      nic_complete(q, step, kSyndromeNone);
      ++t.wqes;
      ++t.writes;
      t.bytes += step.w.bytes;
    }
  }
  if (threadIdx.x == 0) {
    NicStats* s = qp.nic_stats;
    s->consumed = q.ci;
    s->cqes = q.cq_pi;
    s->error = q.error;
    s->wqes += uint32_t(t.wqes);
    totals->wqes += t.wqes;
    totals->bytes += t.bytes;
    totals->writes += t.writes;
    totals->atomics += t.atomics;
    store_release_u32(&s->stopped, 1u);
  }
  return action != kFailed;
}

}  // namespace dc::transport
