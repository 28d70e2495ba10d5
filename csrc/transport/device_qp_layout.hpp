// A queue pair that lives in one GPU allocation: the send ring, the CQ, both doorbell records, the doorbell
// register word, and the counters the GPU posters share. The layout math is written once, here, for the host
// (sizes, views for the tests) and the kernels (carving the pointers).
//
//   offset    what                         bytes
//   ring      send queue WQEBBs            64 << log_wqebbs
//   cqes      completion queue (cqe64)     64 << log_cqes
//   dbrec     u32[2] send doorbell record  8   ([1] = big-endian 16-bit producer index)
//   doorbell  u64 doorbell register        8   (plain memory: the emulated NIC does not read it)
//   cq_dbrec  u32 CQ consumer index record 4
//   poster    QpPosterState                sizeof
//   nic       NicStats                     sizeof
// Every part starts on a 64-byte boundary.
#pragma once
#include <cstdint>

#include "emulated_nic.hpp"

namespace dc::transport {

// Shared by every GPU thread that posts to the queue. Indices are free-running WQEBB counters (32 bits; only
// differences are compared).
struct QpPosterState {
  uint32_t reserved;        // WQEBBs handed out to posters
  uint32_t published;       // WQEBBs announced by the doorbell record; posters publish in reservation order
  uint32_t retired;         // WQEBBs known complete (from CQEs): their slots may be written again
  uint32_t cq_ci;           // CQEs consumed (only touched under `lock`)
  uint32_t lock;            // 1 while one thread polls the CQ
  uint32_t cqes_seen;       // CQEs consumed, for tests and statistics
  uint32_t error_cqes;      // error CQEs seen
  uint32_t first_syndrome;  // syndrome of the first error CQE
};

// What a device NIC leaves behind when it stops.
struct NicStats {
  uint32_t consumed;  // its consumer index (WQEBBs)
  uint32_t wqes;      // WQEs executed or flushed
  uint32_t cqes;      // CQEs written
  uint32_t error;     // syndrome that moved the queue to error, 0 if none
  uint32_t stopped;   // 1 once it returned
};

// What a block NIC (nic_serve_block.cuh) has executed, accumulated over its launches.
struct NicTotals {
  uint64_t wqes;     // WQEs consumed (executed, failed or flushed)
  uint64_t bytes;    // payload bytes of successful writes, plus 8 per successful fetch-add
  uint64_t writes;   // successful RDMA writes (inline included)
  uint64_t atomics;  // successful fetch-adds
};

// A queue's block NIC may be several blocks (nic_serve_block.cuh): a leader that walks the queue and up to
// kNicMaxBlocks - 1 helpers that copy parts of large writes. NicCrew is their hand-off, one per queue pair in
// zeroed memory beside the NicTotals. Every control word holds the launch's round (the stop target) in its high
// half and a count in its low half, so words an earlier launch left are never taken for this launch's.
constexpr int kNicMaxBlocks = 8;
constexpr uint32_t kNicCrewExit = 0xffffffffu;  // low half of `ctl` once the leader has returned

struct NicCrew {
  uint64_t ctl;                    // round | n: copy task n (1, 2, ... per launch) is published; round | exit
  uint64_t beat;                   // round | k: bumped by the leader before each of its doorbell waits
  uint64_t dst, src, bytes, part;  // task n: helper h copies [h * part, min((h + 1) * part, bytes))
  uint64_t unused[2];
  uint64_t done[kNicMaxBlocks - 1][8];  // [h - 1][0]: round | the last task helper h finished (own 64 bytes)
};
static_assert(sizeof(NicCrew) == 64 * kNicMaxBlocks, "NicCrew: 64 bytes of task, 64 per helper");

struct DeviceQpLayout {
  uint32_t log_wqebbs, log_cqes;
  uint64_t ring, cqes, dbrec, doorbell, cq_dbrec, poster, nic, total;

  DC_HD static uint64_t align64(uint64_t v) { return (v + 63) / 64 * 64; }

  DC_HD static DeviceQpLayout make(uint32_t log_wqebbs, uint32_t log_cqes) {
    DeviceQpLayout l{};
    l.log_wqebbs = log_wqebbs;
    l.log_cqes = log_cqes;
    l.ring = 0;
    l.cqes = l.ring + (uint64_t(kWqebbBytes) << log_wqebbs);
    l.dbrec = l.cqes + (uint64_t(kCqeBytes) << log_cqes);
    l.doorbell = l.dbrec + 64;
    l.cq_dbrec = l.doorbell + 64;
    l.poster = l.cq_dbrec + 64;
    l.nic = l.poster + align64(sizeof(QpPosterState));
    l.total = l.nic + align64(sizeof(NicStats));
    return l;
  }
};

// Typed pointers into one queue pair's allocation.
struct DeviceQp {
  SqRing sq;
  SqDoorbell db;
  CqRing cq;
  QpPosterState* poster;
  NicStats* nic_stats;

  DC_HD static DeviceQp at(uint8_t* base, const DeviceQpLayout& l, uint32_t qpn) {
    DeviceQp q{};
    q.sq = SqRing{base + l.ring, l.log_wqebbs, qpn};
    q.db = SqDoorbell{reinterpret_cast<uint32_t*>(base + l.dbrec), reinterpret_cast<uint64_t*>(base + l.doorbell)};
    q.cq = CqRing{base + l.cqes, l.log_cqes, reinterpret_cast<uint32_t*>(base + l.cq_dbrec)};
    q.poster = reinterpret_cast<QpPosterState*>(base + l.poster);
    q.nic_stats = reinterpret_cast<NicStats*>(base + l.nic);
    return q;
  }

  // The NIC's view, its consumer index starting where the posters' indices start.
  DC_HD NicQueue nic_view(uint32_t start) const {
    NicQueue n;
    n.sq = sq;
    n.dbrec = db.dbrec;
    n.cq = cq;
    n.ci = start;
    return n;
  }
};

}  // namespace dc::transport
