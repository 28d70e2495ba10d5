// The traffic check of qp_selftest.cu with CPU threads as posters and as the NIC: the same poster code
// (qp_poster.hpp) and the same nic_serve loop, on host memory, so the reservation / turn / retirement protocol
// and the NIC's stop rule run with real concurrency on machines without a GPU (tests/runtime/test_qp_poster_host.py).
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>

#include "../transport/host_bytes.hpp"
#include "../transport/host_waiter.hpp"
#include "../transport/nic_serve.hpp"
#include "qp_selftest.hpp"

namespace dc {

using namespace transport;

QpHostRun run_qp_traffic_on_host(int channels, int messages, int slot_bytes, int inline_every, uint32_t log_wqebbs,
                                 uint32_t start, const std::vector<uint8_t>& src, double timeout_s, int nic_extra) {
  const size_t area = size_t(channels) * messages * slot_bytes;
  if (channels < 1 || messages < 0 || slot_bytes < 1 || src.size() != area)
    throw std::invalid_argument("run_qp_traffic_on_host: channels >= 1, messages >= 0, slot_bytes >= 1, "
                                "len(src) == channels * messages * slot_bytes");
  const DeviceQpLayout layout = DeviceQpLayout::make(log_wqebbs, log_wqebbs);
  HostBytes qp_mem = alloc_zeroed(layout.total);
  // "local" = our registered memory (source rows, fetch-add results); "remote" = the peer's (rows, counters)
  const size_t fa_bytes = size_t(channels) * messages * 8;
  HostBytes local = alloc_zeroed(area + fa_bytes), remote = alloc_zeroed(area + size_t(channels) * 8);
  std::memcpy(local.get(), src.data(), area);

  const DeviceQp qp = DeviceQp::at(qp_mem.get(), layout, 0x77);
  cq_init(qp.cq);
  qp_init_counters(qp, start);
  KeyTable keys{};
  const uint32_t lkey = 0x11, rkey = 0x22;
  keys.regions[keys.count++] = MemRegion{lkey, uint64_t(uintptr_t(local.get())), area + fa_bytes, local.get()};
  keys.regions[keys.count++] = MemRegion{rkey, uint64_t(uintptr_t(remote.get())), area + size_t(channels) * 8,
                                         remote.get()};

  QpTrafficArgs a{};
  a.qp_base = qp_mem.get();
  a.layout = layout;
  a.qpn = 0x77;
  a.start = start;
  a.channels = channels;
  a.messages = messages;
  a.slot_bytes = slot_bytes;
  a.inline_every = inline_every;
  a.lkey = lkey;
  a.rkey = rkey;
  a.local_src_addr = uint64_t(uintptr_t(local.get()));
  a.local_fa_old_addr = a.local_src_addr + area;
  a.remote_recv_addr = uint64_t(uintptr_t(remote.get()));
  a.remote_counter_addr = a.remote_recv_addr + area;

  std::atomic<int> failed_stage{0};
  const HostWaiter waiter{uint64_t(timeout_s * 1e9), &failed_stage};
  uint32_t posters_done = 0;
  NicQueue nic_queue = qp.nic_view(start);
  std::thread nic([&] {
    nic_serve(nic_queue, keys, &posters_done, uint32_t(channels + nic_extra), waiter, qp.nic_stats);
  });
  std::vector<std::thread> posters;
  for (int c = 0; c < channels; ++c)
    posters.emplace_back([&, c] {
      qp_traffic_post(a, c, waiter);
      __atomic_fetch_add(&posters_done, 1u, __ATOMIC_RELEASE);  // even on failure: the NIC must not wait for us
    });
  for (auto& t : posters) t.join();
  nic.join();

  QpHostRun r;
  r.recv.assign(remote.get(), remote.get() + area);
  r.counters.resize(channels);
  std::memcpy(r.counters.data(), remote.get() + area, size_t(channels) * 8);
  r.fa_old.resize(size_t(channels) * messages);
  std::memcpy(r.fa_old.data(), local.get() + area, fa_bytes);
  r.poster = *qp.poster;
  r.nic = *qp.nic_stats;
  r.failed_stage = failed_stage.load();
  r.dbrec = qp.db.dbrec[kSndDbr];
  return r;
}

}  // namespace dc
