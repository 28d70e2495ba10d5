// The call number of a kernel that starts a collective call (no separate bump kernel before it). Every block's
// thread 0 reads this rank's counter and takes a ticket; the block that takes the last ticket (every block has
// read the counter by then) stores the new number and resets the ticket, so the next kernel on the stream reads
// it. Being device state, the number advances on every CUDA-graph replay too. Call from every thread at entry.
#pragma once
#include <cstdint>

#include "../../ptx/atomic.cuh"
#include "../../ptx/fence.cuh"
#include "error_record.cuh"

namespace dc {

// Thread 0 of a block, once its block has read the call's number `seq` (counter + 1): its entry ticket. The block
// that takes the last one (every block has read the counter by then) stores the number and resets the ticket.
__device__ __forceinline__ void take_entry_ticket(const WaitCtx& in, uint32_t* ticket, uint64_t seq) {
  ptx::fence_acq_rel_gpu();  // our read of the counter comes before our ticket
  if (ptx::atom_add_release_gpu_u32(ticket, 1u) == uint32_t(gridDim.x - 1)) {
    ptx::fence_acq_rel_gpu();  // every block's read came before the last ticket
    *ticket = 0u;
    *const_cast<uint64_t*>(in.seq_ptr) = seq;
  }
}

__device__ __forceinline__ WaitCtx enter_call(const WaitCtx& in, uint32_t* ticket) {
  __shared__ uint64_t seq;
  if (threadIdx.x == 0) {
    seq = *in.seq_ptr + 1;
    take_entry_ticket(in, ticket, seq);
  }
  __syncthreads();
  WaitCtx c = in;
  c.seq = seq;
  return c;
}

}  // namespace dc
