// The device emulated NIC run by whole blocks, for real payloads. The leader block's thread 0 walks the queue
// exactly as nic_drain does (nic_decode_next -> execute -> nic_complete, the same checks and CQEs); the only
// difference is that the payload of a non-inline RDMA write is copied by every thread of the block with 16-byte
// vectors instead of one byte at a time by one thread. Atomics and inline writes stay with thread 0.
//
// A write's copy is made visible at system scope by every copying thread (fence) before the block barrier, so
// a later fetch-add (release, by thread 0) never overtakes the bytes of an earlier write: ordering as on an RC
// queue pair.
//
// One SM copies only ~15-20 GB/s over NVLink, so a queue's NIC may be a crew of `blocks` blocks (at most
// kNicMaxBlocks): the leader (nic_serve_block) and helpers 1.. (nic_help_block), sharing the queue's NicCrew.
// A write of at least kNicSplitMin bytes, 16-byte aligned, is split into `blocks` parts of a multiple of 16 bytes:
// the leader stores the task's fields, then ctl = round | n with a release store, copies part 0 with its block,
// and waits (bounded) until every helper's done word reads round | n. Helper h copies part h with every thread,
// each thread fences at system scope, then after a block barrier its thread 0 stores done with release at
// system scope. The leader's acquire loads of the done words and a system fence order every part before what
// thread 0 does next (the CQE, and any later WQE of the queue, e.g. a release fetch-add signal): the same RC
// ordering, from whichever block the bytes came.
//
// Termination: the leader publishes ctl = round | kNicCrewExit whenever it returns (stopped, or failed), and only
// publishes task n + 1 after every helper finished task n, so a helper never misses a task; a helper returns at
// exit. Its waits are bounded by the waiter too, the clock restarting whenever the leader's beat moves (the
// leader beats just before each of its doorbell waits, themselves bounded): a helper times out, and records it,
// only when the leader has shown no progress for a whole timeout. A leader that loses a helper (its bounded
// wait fails: the helper's own timeout or another recorded failure stops it at once) stops without completing
// the WQE, as after a doorbell timeout.
//
// The queue's NIC state (consumer index, CQ producer index, error) persists in NicStats across launches, so one
// queue pair serves many kernels; NicTotals accumulate what was executed, for tests and the benchmark. Only the
// leader touches them, so they count exactly as with one block.
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

constexpr uint32_t kNicSplitMin = 64u << 10;  // smaller writes: the leader copies alone (no hand-off latency)

__device__ __forceinline__ uint64_t crew_word(uint32_t round, uint32_t n) { return uint64_t(round) << 32 | n; }

// Serve `qp` until *stop_word reaches stop_target (free-running u32, the launch's round) and nothing is pending.
// Every thread of the leader block calls it; with blocks > 1, blocks - 1 helper blocks run nic_help_block on
// the same `crew` and round. Returns false (all threads) on a timeout, recorded by the waiter.
template <typename Waiter>
__device__ bool nic_serve_block(const DeviceQp& qp, const KeyTable& keys, const uint32_t* stop_word,
                                uint32_t stop_target, const Waiter& waiter, NicTotals* totals,
                                NicCrew* crew = nullptr, int blocks = 1) {
  enum : int { kStop = 0, kCopy = 1, kDone = 2, kFailed = 3 };
  __shared__ int action;
  __shared__ uint8_t* copy_dst;
  __shared__ const uint8_t* copy_src;
  __shared__ uint32_t copy_bytes;

  NicQueue q;
  NicStep step;
  NicTotals t{0, 0, 0, 0};
  uint32_t tasks = 0, beats = 0;             // thread 0: crew tasks published, beats
  bool split = false, lost_helper = false;  // thread 0: the current write is shared; a helper wait failed
  if (threadIdx.x == 0) {
    q = qp.nic_view(qp.nic_stats->consumed);
    q.cq_pi = qp.nic_stats->cqes;
    q.error = uint8_t(qp.nic_stats->error);
  }
  for (;;) {
    if (threadIdx.x == 0) {
      uint16_t pi = 0;
      bool have = false;
      if (blocks > 1 && !lost_helper) ptx::st_relaxed_sys_u64(&crew->beat, crew_word(stop_target, ++beats));
      const bool ok = !lost_helper && waiter.wait([&] {
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
            const bool aligned = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | w.bytes) &
                                  15u) == 0;
            split = blocks > 1 && aligned && w.bytes >= kNicSplitMin;
            uint32_t mine = w.bytes;
            if (split) {
              mine = ((w.bytes + uint32_t(blocks) - 1) / uint32_t(blocks) + 15u) / 16u * 16u;  // < w.bytes
              ptx::st_relaxed_sys_u64(&crew->dst, reinterpret_cast<uintptr_t>(dst));
              ptx::st_relaxed_sys_u64(&crew->src, reinterpret_cast<uintptr_t>(src));
              ptx::st_relaxed_sys_u64(&crew->bytes, w.bytes);
              ptx::st_relaxed_sys_u64(&crew->part, mine);
              ptx::st_release_sys_u64(&crew->ctl, crew_word(stop_target, ++tasks));  // the fields before n
            }
            copy_dst = dst;
            copy_src = src;
            copy_bytes = mine;  // part 0
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
      if (split) {  // every helper's part too, before the CQE and whatever this queue executes next
        const uint64_t want = crew_word(stop_target, tasks);
        int h = 1;
        lost_helper = !waiter.wait([&] {
          while (h < blocks && ptx::ld_acquire_sys_u64(&crew->done[h - 1][0]) == want) ++h;
          return h == blocks;
        }, kStageNicDoorbell);
        ptx::fence_acq_rel_sys();
      }
      if (!lost_helper) {  // else: the WQE stays unconsumed and the next turn fails (bytes possibly partial)
        nic_complete(q, step, kSyndromeNone);
        ++t.wqes;
        ++t.writes;
        t.bytes += step.w.bytes;
      }
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
    // Always, stopped or failed: the helpers return once they see it.
    if (blocks > 1) ptx::st_release_sys_u64(&crew->ctl, crew_word(stop_target, kNicCrewExit));
  }
  return action != kFailed;
}

// Helper h (1 <= h < blocks) of a queue's NIC crew, every thread of the block: copy part h of each task the
// leader publishes this launch (`round`: its stop target) until it publishes exit. A helper that times out
// (no task, no exit and no leader beat for a whole timeout) records it and returns; so does one that sees
// another recorded failure.
template <typename Waiter>
__device__ void nic_help_block(NicCrew* crew, int h, uint32_t round, const Waiter& waiter) {
  __shared__ bool go;
  __shared__ uint8_t* copy_dst;
  __shared__ const uint8_t* copy_src;
  __shared__ uint32_t copy_bytes;
  uint32_t last = 0;  // thread 0: the task we finished last (tasks of a launch count from 1)
  uint64_t beat = 0;  // thread 0: the leader's beat when our wait's clock last restarted
  for (;;) {
    if (threadIdx.x == 0) {
      uint64_t c = 0;
      bool ok = true, moved = true;
      while (ok && moved) {  // a new wait (a new clock) each time the leader beats
        moved = false;
        ok = waiter.wait([&] {
          c = ptx::ld_acquire_sys_u64(&crew->ctl);
          if (uint32_t(c >> 32) == round && uint32_t(c) != last) return true;
          const uint64_t b = ptx::ld_relaxed_sys_u64(&crew->beat);
          if (b == beat) return false;
          beat = b;
          return moved = true;
        }, kStageNicDoorbell);
      }
      go = ok && uint32_t(c) != kNicCrewExit;
      if (go) {  // task `c`: its fields were stored before ctl (release), and stay until we report done
        last = uint32_t(c);
        const uint64_t bytes = ptx::ld_relaxed_sys_u64(&crew->bytes), part = ptx::ld_relaxed_sys_u64(&crew->part);
        const uint64_t begin = min(bytes, uint64_t(h) * part), end = min(bytes, begin + part);
        copy_dst = reinterpret_cast<uint8_t*>(ptx::ld_relaxed_sys_u64(&crew->dst)) + begin;
        copy_src = reinterpret_cast<const uint8_t*>(ptx::ld_relaxed_sys_u64(&crew->src)) + begin;
        copy_bytes = uint32_t(end - begin);
      }
    }
    __syncthreads();
    if (!go) break;
    block_copy(copy_dst, copy_src, copy_bytes);
    ptx::fence_acq_rel_sys();
    __syncthreads();  // every thread's part is copied and fenced; `go` and the copy fields may be rewritten
    if (threadIdx.x == 0) ptx::st_release_sys_u64(&crew->done[h - 1][0], crew_word(round, last));
  }
}

// Block `member` (0: the leader) of the `blocks`-block NIC of one queue pair.
template <typename Waiter>
__device__ void nic_crew_block(int member, int blocks, const DeviceQp& qp, const KeyTable& keys,
                               const uint32_t* stop_word, uint32_t stop_target, const Waiter& waiter,
                               NicTotals* totals, NicCrew* crew) {
  if (member == 0) {
    nic_serve_block(qp, keys, stop_word, stop_target, waiter, totals, crew, blocks);
  } else {
    nic_help_block(crew, member, stop_target, waiter);
  }
}

}  // namespace dc::transport
