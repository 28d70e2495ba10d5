// CPU threads running the internode exchange protocol (internode_round.hpp) between two ranks in host memory; see
// internode_host_selftest.hpp.
#include "internode_host_selftest.hpp"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>

#include "../transport/host_bytes.hpp"
#include "../transport/host_waiter.hpp"
#include "../transport/nic_serve.hpp"
#include "../kernels/internode_round.hpp"

namespace dc {

using namespace transport;

namespace {

// One rank's registered memory: signal u64 [2] | credit u64 [2] | fa_old u64 [2] | send [slot] | recv [slot]
struct Region {
  static constexpr size_t kSignal = 0, kCredit = 16, kFaOld = 32, kSend = 64;
  size_t slot;
  HostBytes mem;
  uint8_t* at(size_t off) const { return mem.get() + off; }
  uint64_t addr(size_t off) const { return uint64_t(uintptr_t(at(off))); }
  size_t recv() const { return kSend + slot; }
  size_t total() const { return kSend + 2 * slot; }
};

}  // namespace

InternodeHostRun run_internode_rounds_on_host(const std::vector<std::vector<uint64_t>>& sizes, uint32_t chunk_bytes,
                                              uint32_t log_wqebbs, double timeout_s) {
  if (sizes.size() != 2 || chunk_bytes < 16 || chunk_bytes % 16 != 0)
    throw std::invalid_argument("run_internode_rounds_on_host: two ranks' sizes, chunk_bytes a multiple of 16");
  size_t slot = 16;
  for (const auto& s : sizes)
    for (uint64_t b : s) slot = b > slot ? size_t(b) : slot;
  slot = (slot + 63) / 64 * 64;
  const DeviceQpLayout layout = DeviceQpLayout::make(log_wqebbs, log_wqebbs);
  Region region[2] = {{slot, alloc_zeroed(Region::kSend + 2 * slot)}, {slot, alloc_zeroed(Region::kSend + 2 * slot)}};
  HostBytes qp_mem[2] = {alloc_zeroed(layout.total), alloc_zeroed(layout.total)};
  DeviceQp qp[2];
  KeyTable keys[2];
  for (int r = 0; r < 2; ++r) {
    qp[r] = DeviceQp::at(qp_mem[r].get(), layout, 0x300u + uint32_t(r));
    cq_init(qp[r].cq);
    qp_init_counters(qp[r], 0);
    keys[r] = KeyTable{};
    // lkey: our region; rkey: the peer's, each named by its own address
    keys[r].regions[keys[r].count++] = MemRegion{0x10u + uint32_t(r), region[r].addr(0), region[r].total(),
                                                 region[r].at(0)};
    keys[r].regions[keys[r].count++] = MemRegion{0x20u + uint32_t(1 - r), region[1 - r].addr(0),
                                                 region[1 - r].total(), region[1 - r].at(0)};
  }

  std::atomic<int> failed_stage{0};
  const HostWaiter waiter{uint64_t(timeout_s * 1e9), &failed_stage};
  uint32_t posts_done[2] = {0, 0};
  InternodeHostRun run{};
  NicQueue nic_queue[2] = {qp[0].nic_view(0), qp[1].nic_view(0)};
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      nic_serve(nic_queue[r], keys[r], &posts_done[r], uint32_t(sizes[r].size()), waiter, qp[r].nic_stats);
    });
    threads.emplace_back([&, r] {
      const int peer = 1 - r;
      InternodeHostRank& out = run.rank[r];
      for (size_t k = 1; k <= sizes[r].size(); ++k) {
        const uint64_t bytes = sizes[r][k - 1];
        for (uint64_t i = 0; i < bytes; ++i) region[r].at(Region::kSend)[i] = internode_test_byte(r, k, i);
        InternodeExchangeArgs a{};
        a.num_peers = 1;
        a.lkey = 0x10u + uint32_t(r);
        a.round = k;
        a.chunk_bytes = chunk_bytes;
        InternodePeer p{};
        p.rank = uint64_t(peer);
        p.send_addr = region[r].addr(Region::kSend);
        p.send_bytes = bytes;
        p.recv_addr = region[peer].addr(region[peer].recv());
        p.signal_addr = region[peer].addr(Region::kSignal + 8 * size_t(r));
        p.credit_addr = region[peer].addr(Region::kCredit + 8 * size_t(r));
        p.rkey = 0x20u + uint32_t(peer);
        p.fa_old_addr = region[r].addr(Region::kFaOld);
        p.signal_ptr = region[r].addr(Region::kSignal + 8 * size_t(peer));
        p.credit_ptr = region[r].addr(Region::kCredit + 8 * size_t(peer));
        const bool ok = internode_post_round(a, p, qp[r], waiter);
        __atomic_fetch_add(&posts_done[r], 1u, __ATOMIC_RELEASE);  // even on failure: the NIC must not wait
        if (!ok) break;
        if (!internode_wait_counter(reinterpret_cast<const uint64_t*>(p.signal_ptr), k, waiter, kStageQpSignal)) break;
        // The peer's block for this round, checked before our next credit lets it write the slot again.
        const uint8_t* got = region[r].at(region[r].recv());
        const uint64_t n = k <= sizes[peer].size() ? sizes[peer][k - 1] : 0;
        bool same = true;
        for (uint64_t i = 0; i < n && same; ++i) same = got[i] == internode_test_byte(peer, k, i);
        out.mismatched_rounds += same ? 0 : 1;
        ++out.rounds_done;
      }
    });
  }
  for (auto& t : threads) t.join();

  for (int r = 0; r < 2; ++r) {
    InternodeHostRank& out = run.rank[r];
    const auto* fa = reinterpret_cast<const uint64_t*>(region[r].at(Region::kFaOld));
    out.fa_old.assign(fa, fa + 2);
    out.signal = *reinterpret_cast<const uint64_t*>(region[r].at(Region::kSignal + 8 * size_t(1 - r)));
    out.credit = *reinterpret_cast<const uint64_t*>(region[r].at(Region::kCredit + 8 * size_t(1 - r)));
    out.poster = *qp[r].poster;
    out.nic = *qp[r].nic_stats;
  }
  run.failed_stage = failed_stage.load();
  return run;
}

}  // namespace dc
