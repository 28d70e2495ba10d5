// The internode exchange: every rank sends one block of bytes to every other rank through GPU-posted mlx5 WQEs
// (one queue pair per peer), executed by the device emulated NIC over NVLink peer pointers, or by a ConnectX on
// a cluster. deepcomm/internode/backend.py builds normal dispatch and combine on it.
//
// One round, per peer p (one poster thread per peer, nic_blocks NIC blocks per queue pair; one grid):
//   1. credit: a signaled fetch-add of 1 on p's credit[me]: "my receive slot for you is free" (this round's
//      launch is ordered after our last read of it);
//   2. wait until our credit[p] >= round: p's slot for us is free;
//   3. RDMA writes of our block, in chunks of chunk_bytes, into p's receive slot for us (one inline write when
//      the block fits in a WQE, kMaxInlineBytes: the count exchange);
//   4. signal: a signaled fetch-add of 1 on p's signal[me], after the writes on the same queue, so it never
//      overtakes them;
//   5. quiet (all our WQEs completed), then wait until our signal[p] >= round: p's block has landed here.
// Every wait is bounded (wait_until): kStageInternodeCredit, kStageQpSignal, the queue's own stages.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../runtime/error_record.cuh"
#include "../transport/key_table.hpp"

namespace dc {

// One peer's part of a round. All fields 64-bit: the host fills an int64 tensor [peers][kInternodePeerFields].
// "addr" fields are WQE addresses (the owner's own virtual address, translated by the key table); "ptr"
// fields are device pointers in this process.
struct InternodePeer {
  uint64_t rank;
  uint64_t qp_base;        // ptr: the queue pair's allocation (device_qp_layout.hpp)
  uint64_t qpn;
  uint64_t send_addr;      // addr (lkey): our block for p
  uint64_t send_bytes;     // may be 0: then only credit and signal travel
  uint64_t recv_addr;      // addr (rkey): p's receive slot for us
  uint64_t signal_addr;    // addr (rkey): p's signal[me], u64
  uint64_t credit_addr;    // addr (rkey): p's credit[me], u64
  uint64_t rkey;
  uint64_t fa_old_addr;    // addr (lkey): 16 bytes where the two fetch-adds return the old values
  uint64_t signal_ptr;     // ptr: our signal[p]
  uint64_t credit_ptr;     // ptr: our credit[p]
  uint64_t stop_ptr;       // ptr: u32, +1 per round once the poster is done with the queue (the NIC's stop word)
  uint64_t totals_ptr;     // ptr: transport::NicTotals of this queue's NIC, accumulated
  uint64_t crew_ptr;       // ptr: transport::NicCrew of this queue's NIC (zeroed once; used with nic_blocks > 1)
};
constexpr int kInternodePeerFields = sizeof(InternodePeer) / 8;
static_assert(sizeof(InternodePeer) % 8 == 0, "InternodePeer must be 64-bit fields only");

struct InternodeExchangeArgs {
  const InternodePeer* peers;  // device array [num_peers]
  int num_peers;
  uint32_t lkey;
  uint64_t round;              // 1, 2, ... the same on every rank
  uint32_t chunk_bytes;        // bytes per RDMA write WQE (a multiple of 16)
  uint32_t log_wqebbs, log_cqes;
  int nic_blocks;              // blocks per queue pair's NIC, in [1, transport::kNicMaxBlocks]
};

// Launch one round: num_peers poster blocks, then num_peers * nic_blocks NIC blocks (queue j's at
// j * nic_blocks.., its leader first), no more than the SMs (all resident).
void launch_internode_exchange(const InternodeExchangeArgs& args, const transport::KeyTable& keys,
                               const WaitCtx& ctx, cudaStream_t stream);

}  // namespace dc
