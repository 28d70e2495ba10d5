// The poster block of the hierarchical kernels over NVSHMEM's device API (compiled only into
// deepcomm._nvshmem_kernels, with -rdc and libnvshmem_device; hier_roles.cuh picks it under
// DEEPCOMM_NVSHMEM_DEVICE). The memory is NvshmemTransport's symmetric block: signal u64[R], credit u64[R], a send
// area and R receive slots at the same offsets on every PE (PE = rank), so "peer p's slot for us" is our own
// address of slot [rank], handed to NVSHMEM with pe = p.
//
// One launch's round r with rail peer p (contract in hier_kernels.hpp):
//   1. thread j: signal_op(credit[me] on p := r, SET): our slot for p is free (stream order: our previous launch,
//      which read it, is finished);
//   2. once every producer block is done, warp j (peers round-robin over the warps): lane 0 waits, bounded, for
//      our credit[p] >= r (stage nvshmem:credit), so nothing lands in a slot p may still read;
//   3. the warp splits the block into kNvshmemChunks 16-byte-aligned chunks and issues each as
//      putmem_signal_nbi_warp(slot, chunk, signal[me] on p += 1); an empty chunk is a lone signal_op ADD 1, so
//      every round adds exactly kNvshmemChunks to p's word whatever the bytes (the receiver waits, bounded, for
//      signal[p] >= r * kNvshmemChunks: hier_roles.cuh block_wait_signal, stage nvshmem:signal);
//   4. lane 0 quiets: every put of this launch has left our send area before the kernel ends (the next launch
//      packs into it before it waits for credits).
// NVSHMEM's own waits (signal_wait_until, wait_until) are never used: they cannot give up on a missing peer.
// On one host NVSHMEM's peer-to-peer path carries the puts (warp copies over NVLink, a remote atomic for the
// signal); across hosts its IBGDA or proxy transport does, with the same calls.
#pragma once
#include <nvshmem.h>
#include <nvshmemx.h>

#include "../runtime/wait.cuh"
#include "hier_kernels.hpp"

namespace dc::hier {

// Bytes [b0, b1) of chunk c of an n-byte block: equal 16-byte-aligned parts, the last ones possibly empty.
__device__ __forceinline__ void nvshmem_chunk(uint64_t n, int c, uint64_t& b0, uint64_t& b1) {
  const uint64_t per = ((n + kNvshmemChunks - 1) / kNvshmemChunks + 15) / 16 * 16;
  b0 = min(n, uint64_t(c) * per);
  b1 = min(n, uint64_t(c + 1) * per);
}

template <typename Bytes>
__device__ void nvshmem_poster_block(const HierRdma& r, const HierTopo& t, const uint32_t* done, uint32_t blocks,
                                     Bytes bytes_of, const WaitCtx& ctx) {
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int P = r.num_peers;
  // 1. credits first: a peer may be waiting for them already (node ascending, ours skipped: peer_node).
  for (int j = tid; j < P; j += kHierThreads) {
    const int pe = (j < t.node ? j : j + 1) * t.gpus + t.local;
    nvshmemx_signal_op(r.credit + t.rank, r.round, NVSHMEM_SIGNAL_SET, pe);
  }
  bool ready = true;
  if (lane == 0)
    ready = wait_until([&] { return ptx::ld_acquire_sys_u32(done) >= blocks; }, ctx, ctx.rank, kStageHierLocal);
  ready = __shfl_sync(0xffffffffu, ready, 0);
  if (!ready) return;
  ptx::fence_acq_rel_sys();  // every producer block's rows (system-fenced before its count) before our puts
  bool issued = false;
  for (int j = warp; j < P; j += kHierThreads / 32) {
    const int pe = (j < t.node ? j : j + 1) * t.gpus + t.local;
    bool ok = true;
    if (lane == 0) ok = wait_flag_geq(r.credit + pe, r.round, ctx, pe, kStageNvshmemCredit);
    ok = __shfl_sync(0xffffffffu, ok, 0);
    if (!ok) continue;  // the peer never freed its slot: it gets nothing and will time out on our signal
    const uint64_t n = bytes_of(j) + r.header_bytes;  // the section's header (its start) travels too
    uint8_t* dst = const_cast<uint8_t*>(r.recv) + int64_t(t.rank) * r.slot_bytes;  // symmetric: p's slot for us
    const uint8_t* src = r.send + int64_t(pe) * r.slot_bytes;
    uint64_t* sig = const_cast<uint64_t*>(r.signal) + t.rank;
    for (int c = 0; c < kNvshmemChunks; ++c) {
      uint64_t b0, b1;
      nvshmem_chunk(n, c, b0, b1);
      if (b1 > b0) {
        nvshmemx_putmem_signal_nbi_warp(dst + b0, src + b0, size_t(b1 - b0), sig, 1, NVSHMEM_SIGNAL_ADD, pe);
      } else if (lane == 0) {
        nvshmemx_signal_op(sig, 1, NVSHMEM_SIGNAL_ADD, pe);
      }
      __syncwarp();
    }
    issued = true;
  }
  if (issued && lane == 0) nvshmem_quiet();
}

}  // namespace dc::hier
