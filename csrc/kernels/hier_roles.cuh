// Pieces both hierarchical kernels share (contract in hier_kernels.hpp): the poster and NIC blocks of the RDMA
// hop, the free / arrive words of the NVLink hop, the block-done counters, and row copies that read memory other
// agents write during the launch.
#pragma once
#include <string>

#include "../runtime/cuda_check.hpp"
#include "../runtime/wait.cuh"
#include "../transport/device_qp.cuh"
#include "../transport/nic_serve_block.cuh"
#include "hier_kernels.hpp"
#include "internode_round.hpp"
#include "warp_copy.cuh"
#ifdef DEEPCOMM_NVSHMEM_DEVICE
#include "hier_nvshmem_poster.cuh"
#endif

namespace dc::hier {

using namespace transport;

__device__ __forceinline__ int rail_rank(const HierTopo& t, int node) { return node * t.gpus + t.local; }
__device__ __forceinline__ int node_rank(const HierTopo& t, int g) { return t.node * t.gpus + g; }
// The node of queue pair j in HierRdma::peers (nodes ascending, ours skipped).
__device__ __forceinline__ int peer_node(const HierTopo& t, int j) { return j < t.node ? j : j + 1; }

// A warp copies n16 16-byte vectors with coherent loads (the source may have been written during this launch,
// by our NIC or a node GPU, before the acquire that ordered it).
__device__ __forceinline__ void warp_copy_fresh(const int4* src, int4* dst, int64_t n16, int lane) {
  warp_copy_v4<4, true>(src, dst, n16, lane);
}

// Block-wide: n call-fingerprint headers (kRailHeaderBytes each, 16-byte aligned), header i from src_of(i) to
// dst_of(i) (a node GPU's strip, or a send section), four 16-byte vectors per header, coherent loads (a source may
// have been written during this launch, by our NIC or a node GPU, before the acquire that ordered it). Ends with
// __syncthreads; the stores are ordered for other agents by the caller's next block_done.
template <typename Src, typename Dst>
__device__ __forceinline__ void copy_headers(int n, Src src_of, Dst dst_of) {
  constexpr int kVecs = int(kRailHeaderBytes / 16);
  __syncthreads();  // the waits that ordered the sources are done in every thread
  for (int t = int(threadIdx.x); t < kVecs * n; t += int(blockDim.x)) {
    const int i = t / kVecs, v = t % kVecs;
    const int4 x = ptx::ld_relaxed_gpu_v4(reinterpret_cast<const int4*>(src_of(i)) + v);
    reinterpret_cast<int4*>(dst_of(i))[v] = x;
  }
  __syncthreads();
}

// First thing in a launch: block 0 zeroes the next launch's counters (the launches alternate between two sets of
// [4]). No block of this launch touches them, and the next launch starts after this one ends (stream order), so
// the zeroing needs no launch of its own.
__device__ __forceinline__ void zero_next_counters(uint32_t* next) {
  if (blockIdx.x == 0 && threadIdx.x < 4 && next != nullptr) next[threadIdx.x] = 0u;
}

// Block-wide: every thread's earlier stores are visible at system scope, then thread 0 adds 1 to the launch
// counter. Returns (in every thread) the count before our add, so the caller can tell it was the last block.
__device__ __forceinline__ uint32_t block_done(uint32_t* counter) {
  __shared__ uint32_t before;
  __syncthreads();
  if (threadIdx.x == 0) {
    ptx::fence_acq_rel_sys();
    before = ptx::atom_add_release_gpu_u32(counter, 1u);
    ptx::fence_acq_rel_sys();  // what the blocks counted before us did is ordered before what we do next
  }
  __syncthreads();
  return before;
}

// Thread 0 waits (bounded) until the launch counter reaches `target`; the block then sees what those blocks did.
__device__ __forceinline__ bool block_wait_count(const uint32_t* counter, uint32_t target, const WaitCtx& ctx) {
  __shared__ bool ok;
  __syncthreads();  // every thread has read `ok` of the previous wait
  if (threadIdx.x == 0) {
    ok = wait_until([&] { return ptx::ld_acquire_sys_u32(counter) >= target; }, ctx, ctx.rank, kStageHierLocal);
    ptx::fence_acq_rel_sys();
  }
  __syncthreads();
  return ok;
}

// Threads 0..G-1 store `epoch` into word [local] of every node GPU's array (a system fence first: everything
// this block ordered before is visible at that GPU before the word).
__device__ __forceinline__ void raise_node_words(uint64_t* const* words, const HierTopo& t, uint64_t epoch) {
  __syncthreads();
  if (int(threadIdx.x) < t.gpus) {
    ptx::fence_acq_rel_sys();
    ptx::st_release_sys_u64(words[threadIdx.x] + t.local, epoch);
  }
  __syncthreads();
}

// Thread 0 waits until our word [g] (raised by node GPU g) reaches epoch; the whole block returns the result.
__device__ __forceinline__ bool block_wait_node_word(const uint64_t* mine, int g, uint64_t epoch, const HierTopo& t,
                                                     const WaitCtx& ctx, int stage) {
  __shared__ bool ok;
  __syncthreads();  // every thread has read `ok` of the previous wait
  if (threadIdx.x == 0) {
    ok = wait_flag_geq(mine + g, epoch, ctx, node_rank(t, g), stage);
    ptx::fence_acq_rel_sys();
  }
  __syncthreads();
  return ok;
}

// Thread 0 waits until rail rank s's block of this round has landed in recv (its NIC raised our signal[s]).
__device__ __forceinline__ bool block_wait_signal(const HierRdma& r, int s, const WaitCtx& ctx) {
  __shared__ bool ok;
  __syncthreads();  // every thread has read `ok` of the previous wait
  if (threadIdx.x == 0) {
    ok = wait_flag_geq(r.signal + s, r.signal_target, ctx, s, r.nvshmem_puts ? kStageNvshmemSignal : kStageQpSignal);
    ptx::fence_acq_rel_sys();
  }
  __syncthreads();
  return ok;
}

// The poster block: thread j < num_peers runs the exchange round with peer j once the launch counter says every
// one of `blocks` producer blocks is done; bytes_of(j) gives the size of the block's rows then (the section's
// header_bytes come on top, at its start).
template <typename Bytes>
__device__ void poster_block(const HierRdma& r, const HierTopo& t, const uint32_t* done, uint32_t blocks,
                             Bytes bytes_of, const WaitCtx& ctx) {
#ifdef DEEPCOMM_NVSHMEM_DEVICE
  nvshmem_poster_block(r, t, done, blocks, bytes_of, ctx);
  return;
#endif
  (void)t;
  const int j = int(threadIdx.x);
  if (j >= r.num_peers) return;
  InternodePeer p = r.peers[j];
  const DeviceQp qp = DeviceQp::at(reinterpret_cast<uint8_t*>(p.qp_base),
                                   DeviceQpLayout::make(r.log_wqebbs, r.log_cqes), uint32_t(p.qpn));
  const DeviceWaiter waiter{ctx, int(p.rank)};
  const bool ready = wait_until([&] { return ptx::ld_acquire_sys_u32(done) >= blocks; }, ctx, ctx.rank,
                                kStageHierLocal);
  if (ready) {
    ptx::fence_acq_rel_sys();
    p.send_bytes = bytes_of(j) + r.header_bytes;  // the section's header (its start) travels too
    InternodeExchangeArgs a{};
    a.lkey = r.lkey;
    a.round = r.round;
    a.chunk_bytes = r.chunk_bytes;
    a.log_wqebbs = r.log_wqebbs;
    a.log_cqes = r.log_cqes;
    internode_post_round(a, p, qp, waiter);
  }
  ptx::atom_add_release_gpu_u32(reinterpret_cast<uint32_t*>(p.stop_ptr), 1u);  // our NIC stops even after a failure
}

// NIC block i (emulated NIC): block i % nic_blocks of queue pair i / nic_blocks's NIC, which serves the queue
// until its poster is done with this round.
__device__ __forceinline__ void nic_block(const HierRdma& r, int i, const KeyTable& keys, const WaitCtx& ctx) {
  const InternodePeer p = r.peers[i / r.nic_blocks];
  const DeviceQp qp = DeviceQp::at(reinterpret_cast<uint8_t*>(p.qp_base),
                                   DeviceQpLayout::make(r.log_wqebbs, r.log_cqes), uint32_t(p.qpn));
  const DeviceWaiter waiter{ctx, int(p.rank)};
  nic_crew_block(i % r.nic_blocks, r.nic_blocks, qp, keys, reinterpret_cast<uint32_t*>(p.stop_ptr),
                 uint32_t(r.round), waiter, reinterpret_cast<NicTotals*>(p.totals_ptr),
                 reinterpret_cast<NicCrew*>(p.crew_ptr));
}

// Host: the checks both launchers share (topology, queue pairs, roles, NIC crews) and the grid's block count,
// which must fit the device at once because the blocks wait on each other. `what` names the kernel in messages.
inline int checked_grid_blocks(const HierTopo& t, const HierRdma& r, int rdma_blocks, int nvl_blocks,
                               const std::string& what) {
  DC_HOST_ASSERT(t.num_nodes >= 1 && t.num_nodes <= kHierMaxNodes,
                 what + ": num_nodes must be in [1, " + std::to_string(kHierMaxNodes) + "]");
  DC_HOST_ASSERT(t.gpus >= 1 && t.gpus <= kMaxNodeGpus,
                 what + ": gpus per node must be in [1, " + std::to_string(kMaxNodeGpus) + "]");
  DC_HOST_ASSERT(internode_topology_fits(t.num_nodes, t.gpus),
                 what + ": at most " + std::to_string(kInternodeMaxRanks) + " ranks (num_nodes * gpus)");
  DC_HOST_ASSERT(t.node >= 0 && t.node < t.num_nodes && t.local >= 0 && t.local < t.gpus &&
                     t.rank == t.node * t.gpus + t.local,
                 what + ": topo must have node < num_nodes, local < gpus, rank = node * gpus + local");
  DC_HOST_ASSERT(r.num_peers == t.num_nodes - 1 && r.num_peers <= kHierThreads,
                 what + ": num_peers must be num_nodes - 1");
  DC_HOST_ASSERT(rdma_blocks >= 1 && nvl_blocks >= 1, what + ": rdma_blocks and nvl_blocks must be >= 1");
  DC_HOST_ASSERT(r.header_bytes % 16 == 0 && r.header_bytes <= r.slot_bytes,
                 what + ": header_bytes must be a multiple of 16 and fit the slot");
  DC_HOST_ASSERT(!r.emulate_nic || (r.nic_blocks >= 1 && r.nic_blocks <= kNicMaxBlocks),
                 what + ": nic_blocks must be in [1, " + std::to_string(kNicMaxBlocks) + "]");
#ifdef DEEPCOMM_NVSHMEM_DEVICE
  DC_HOST_ASSERT(r.nvshmem_puts && !r.emulate_nic && r.credit != nullptr &&
                     r.signal_target == r.round * uint64_t(kNvshmemChunks),
                 what + ": the NVSHMEM kernels need nvshmem_puts, no emulated NIC, credit words and "
                        "signal_target = round * kNvshmemChunks");
#else
  DC_HOST_ASSERT(!r.nvshmem_puts && r.signal_target == r.round,
                 what + ": NVSHMEM device puts need deepcomm._nvshmem_kernels; here signal_target must be round");
#endif
  int device = 0, sms = 0;
  DC_CUDA_CHECK(cudaGetDevice(&device));
  DC_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int blocks = rdma_blocks + nvl_blocks + 1 + (r.emulate_nic ? r.num_peers * r.nic_blocks : 0);
  DC_HOST_ASSERT(blocks <= sms, what + ": " + std::to_string(blocks) + " blocks (rdma + nvl + poster + NICs) " +
                                    "exceed the " + std::to_string(sms) + " SMs; lower num_sms");
  return blocks;
}

}  // namespace dc::hier
