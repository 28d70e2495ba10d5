// One exchange round of NvshmemTransport (deepcomm/internode/nvshmem_transport.py) issued from the GPU: the rounds
// the hierarchical kernels do not carry themselves (a fresh dispatch's count round, a rejected call's words), so
// that they cost the host no sync. Same contract as the host-API round, in one launch on the caller's stream:
//   1. every peer p: credit[me] on p := round (SET): our receive slot for p is free (stream order: everything of
//      ours that read it is finished);
//   2. one warp per peer: wait, bounded, for our credit[p] >= round (stage nvshmem:credit); a peer that never
//      frees its slot gets nothing and times out on our signal instead;
//   3. our block for p into p's slot for us, then p's signal[me] := landed (SET) with the put (put-with-signal;
//      a zero-byte block is the signal alone);
//   4. quiet: the send area may be packed again once the launch is done.
// The receiver's wait for the signals stays the bounded counter wait (csrc/kernels/counter_wait.hpp).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "../runtime/error_record.cuh"

namespace dc {

constexpr int kRailRoundMaxPeers = 64;  // peers per launch (kernel parameter space); more: the host-API round
constexpr int kRailRoundThreads = 256;

struct RailRoundPeer {
  int pe;          // the peer's rank (its NVSHMEM PE)
  int pad;
  uint64_t bytes;  // our block for it: bytes [begin, begin + bytes) of the send area
  uint64_t begin;
};

struct RailRoundArgs {
  uint64_t* signal;     // symmetric u64 [R]: signal[s] raised by s when its block for us has landed
  uint64_t* credit;     // symmetric u64 [R]: credit[s] raised by s when its slot for us is free
  const uint8_t* send;  // symmetric send area
  uint8_t* recv;        // symmetric receive slots: slot s (from rank s) at recv + s * slot_bytes
  int64_t slot_bytes;
  int rank;
  int num_peers;        // 0..kRailRoundMaxPeers
  uint64_t round;       // the credit value of this round
  uint64_t landed;      // the signal value this round sets
  RailRoundPeer peers[kRailRoundMaxPeers];
};

void launch_rail_round(const RailRoundArgs& args, const WaitCtx& ctx, cudaStream_t stream);

}  // namespace dc
