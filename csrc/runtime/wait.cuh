// Bounded spin-waits. Every device wait in deepcomm goes through wait_until so that it either sees its
// condition or, after ctx.timeout_ns, records (rank, peer, stage) in the ErrorRecord and returns false.
#pragma once
#include "../../ptx/ptx.cuh"
#include "error_record.cuh"

namespace dc {

__device__ __forceinline__ void write_record(const WaitCtx& ctx, int peer, int stage, uint64_t waited) {
  ctx.err->rank = ctx.rank;
  ctx.err->peer = peer;
  ctx.err->stage = stage;
  ctx.err->seq = ctx.seq;
  ctx.err->waited_ns = waited;
  ptx::st_release_sys_u32(reinterpret_cast<uint32_t*>(&ctx.err->flag), 1u);
}

// The first failure wins (flag: 0 = none, 2 = being written, 1 = complete); a timeout also replaces a recorded
// input error (stage >= kStageInvalidIds), which is only a ValueError waiting for the host. The claim is a
// GPU-scope CAS: the record is in mapped host memory and only this GPU writes it.
__device__ __forceinline__ void report_timeout(const WaitCtx& ctx, int peer, int stage, uint64_t waited) {
  auto* flag = reinterpret_cast<uint32_t*>(&ctx.err->flag);
  if (ptx::atom_cas_acquire_gpu_u32(flag, 0u, 2u) == 0u) {
    write_record(ctx, peer, stage, waited);
  } else if (stage < kStageInvalidIds && ptx::ld_volatile_s32(&ctx.err->stage) >= kStageInvalidIds &&
             ptx::atom_cas_acquire_gpu_u32(flag, 1u, 2u) == 1u) {
    write_record(ctx, peer, stage, waited);
  }
}

// Another thread already timed out: stop waiting at once instead of burning the whole timeout again. Recorded
// input errors do not stop waits: those calls still complete on every rank.
__device__ __forceinline__ bool someone_failed(const WaitCtx& ctx) {
  return ptx::ld_acquire_sys_u32(reinterpret_cast<const uint32_t*>(&ctx.err->flag)) == 1u &&
         ptx::ld_volatile_s32(&ctx.err->stage) < kStageInvalidIds;
}

template <typename Done>
__device__ __forceinline__ bool wait_until(Done done, const WaitCtx& ctx, int peer, int stage) {
  if (done()) return true;
  const uint64_t start = ptx::globaltimer_ns();
  for (uint32_t spin = 1;; ++spin) {
    if (done()) return true;
    if ((spin & 1023u) == 0u) {
      const uint64_t waited = ptx::globaltimer_ns() - start;
      if (waited > ctx.timeout_ns) {
        report_timeout(ctx, peer, stage, waited);
        return false;
      }
      if (someone_failed(ctx)) return false;
    }
  }
}

// Record an input problem found on the device (not a timeout); the first record wins.
__device__ __forceinline__ void report_input_error(const WaitCtx& ctx, int peer, int stage) {
  report_timeout(ctx, peer, stage, 0);
}

// Claim an empty record for an input error whose details are still being gathered (flag 2 = being written, which
// the host leaves for its next look); write_record completes it. False when the record already holds one.
__device__ __forceinline__ bool claim_error_record(const WaitCtx& ctx) {
  return ptx::atom_cas_acquire_gpu_u32(reinterpret_cast<uint32_t*>(&ctx.err->flag), 0u, 2u) == 0u;
}

// Wait until *flag (a u64 written by a peer with release semantics) reaches `target`.
__device__ __forceinline__ bool wait_flag_geq(const uint64_t* flag, uint64_t target, const WaitCtx& ctx, int peer,
                                              int stage) {
  return wait_until([&] { return ptx::ld_acquire_sys_u64(flag) >= target; }, ctx, peer, stage);
}

}  // namespace dc
