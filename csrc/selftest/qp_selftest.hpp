// GPU checks of the device queue pair and the device emulated NIC (tests/runtime/test_device_qp.py).
// Launchers take raw pointers; the runners marked "synchronous" wait for the kernel before returning.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "../runtime/error_record.cuh"
#include "../transport/qp_poster.hpp"

namespace dc {

// One WQE for the encoding check: what the host encoders take.
enum QpTestKind : uint32_t { kQpTestWrite = 0, kQpTestWriteImm = 1, kQpTestInline = 2, kQpTestFetchAdd = 3 };
struct QpTestWqe {
  uint32_t kind;
  uint8_t fm_ce_se, signature;
  uint32_t imm;
  uint64_t laddr, raddr, add;
  uint32_t lkey, rkey, bytes;
  const uint8_t* payload;  // device memory, inline writes
};

// Synchronous. Thread i of one block posts specs[i] through the device poster path (concurrently with the
// others); returns the WQE index each got. Nothing drains the queue: the specs must fit in the free slots.
std::vector<uint32_t> run_qp_encode_selftest(uint8_t* qp_base, const transport::DeviceQpLayout& layout, uint32_t qpn,
                                             const std::vector<QpTestWqe>& specs, const WaitCtx& ctx);

// Traffic: `channels` poster threads (one per block) each send `messages` messages through one queue pair to
// the peer; message m of channel c is an RDMA write (or, every inline_every-th, an inline write) of
// qp_test_message_bytes(c, m) bytes from our src slot to the peer's recv slot (same offset), followed by a
// signaled fetch-add of 1 on the peer's counter[c], whose old value lands in our fa_old[c][m]. One more block
// runs the NIC; `channels` more blocks check our own receive side: for every m they wait until counter[c] > m
// and compare recv slot (c, m) with the sender's src slot, read through its peer pointer.
// Addresses in WQEs are the owners' own virtual addresses, translated by `keys` (lkey: ours, rkey: the peer's).
struct QpTrafficArgs {
  uint8_t* qp_base;
  transport::DeviceQpLayout layout;
  uint32_t qpn, start;
  int channels, messages, slot_bytes, inline_every;
  uint32_t lkey, rkey;
  uint64_t local_src_addr, local_fa_old_addr;         // WQE addresses (ours)
  uint64_t remote_recv_addr, remote_counter_addr;     // WQE addresses (the peer's)
  const uint8_t* peer_src;                            // the peer's src area through our mapping (checker)
  uint8_t* recv;                                      // [channels][messages][slot_bytes], written by the peer's NIC
  const uint64_t* counters;                           // [channels], fetch-added by the peer's NIC
  uint32_t* posters_done;                             // zeroed
  uint32_t nic_stop_target;                           // channels, or more to test the NIC's timeout
  int* mismatches;                                    // zeroed: messages whose bytes differed when signalled
};
void launch_qp_traffic(const QpTrafficArgs& args, const transport::KeyTable& keys, const WaitCtx& ctx, int peer,
                       cudaStream_t stream);

// Shared by the kernel and the Python test: the size of message m of channel c (1 .. slot_bytes), and whether
// it goes inline (then at most kMaxInlineBytes).
DC_HD uint32_t qp_test_message_bytes(int c, int m, int slot_bytes, int inline_every) {
  uint32_t bytes = 1u + uint32_t((uint64_t(c) * 7919u + uint64_t(m) * 104729u + 17u) % uint64_t(slot_bytes));
  if (inline_every > 0 && m % inline_every == 0 && bytes > transport::kMaxInlineBytes)
    bytes = 1u + bytes % transport::kMaxInlineBytes;
  return bytes;
}
DC_HD bool qp_test_is_inline(int m, int inline_every) {
  return inline_every > 0 && m % inline_every == 0;
}

// Channel c's side of the traffic (one thread, GPU or CPU): per message a write (or inline write), unsignaled,
// then a signaled fetch-add; then wait until all of them completed. False on timeout or error CQE.
template <typename Waiter>
DC_HD bool qp_traffic_post(const QpTrafficArgs& a, int c, const Waiter& waiter) {
  const transport::DeviceQp qp = transport::DeviceQp::at(a.qp_base, a.layout, a.qpn);
  transport::WqeCtrl unsignaled;
  unsignaled.fm_ce_se = 0;
  const transport::WqeCtrl signaled;  // kCtrlCqUpdate: every signal completes, retiring the WQEs before it
  bool ok = true;
  uint32_t end = 0;
  for (int m = 0; m < a.messages && ok; ++m) {
    const uint64_t off = (uint64_t(c) * a.messages + m) * a.slot_bytes;
    const uint32_t bytes = qp_test_message_bytes(c, m, a.slot_bytes, a.inline_every);
    if (qp_test_is_inline(m, a.inline_every)) {
      ok = transport::qp_post_write_inline(qp, reinterpret_cast<const uint8_t*>(a.local_src_addr + off), bytes,
                                           a.remote_recv_addr + off, a.rkey, unsignaled, waiter);
    } else {
      ok = transport::qp_post_write(
          qp, transport::RdmaWrite{a.local_src_addr + off, a.lkey, a.remote_recv_addr + off, a.rkey, bytes},
          unsignaled, false, waiter);
    }
    uint32_t index = 0;
    const uint64_t slot = uint64_t(c) * a.messages + m;
    ok = ok && transport::qp_post_fetch_add(qp, transport::FetchAdd{a.local_fa_old_addr + slot * 8, a.lkey,
                                                                    a.remote_counter_addr + uint64_t(c) * 8, a.rkey, 1},
                                            signaled, waiter, &index);
    end = index + transport::wqebbs_of_ds(transport::kDsFetchAdd);
  }
  if (ok && a.messages > 0) ok = transport::qp_quiet(qp, end, waiter);
  return ok;
}

// The same traffic on the host: `channels` CPU threads post through qp_traffic_post into a queue pair in host
// memory and one more thread runs nic_serve into a second host buffer ("remote"); the NIC waits for
// channels + nic_extra posters. Synchronous.
struct QpHostRun {
  std::vector<uint8_t> recv;          // [channels][messages][slot_bytes]
  std::vector<uint64_t> counters;     // [channels]
  std::vector<uint64_t> fa_old;       // [channels][messages]
  transport::QpPosterState poster;
  transport::NicStats nic;
  uint32_t dbrec;
  int failed_stage;                   // 0, or the WaitStage of the first failed wait
};
QpHostRun run_qp_traffic_on_host(int channels, int messages, int slot_bytes, int inline_every, uint32_t log_wqebbs,
                                 uint32_t start, const std::vector<uint8_t>& src, double timeout_s, int nic_extra);

}  // namespace dc
