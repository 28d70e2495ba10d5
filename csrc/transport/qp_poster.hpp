// The poster's side of a queue pair in shared memory (GPU memory for GPU threads, host memory for the CPU
// checks of the same code): reserve WQEBBs, encode the WQE with the host's encoders, publish in reservation
// order (doorbell record then doorbell, release ordering), and retire slots from CQEs. Any number of threads
// may post to one queue at once.
//
// Post = reserve -> wait for room -> encode -> wait for our turn -> ring_doorbell(pi) -> published = pi.
//   * reserve: an atomic add on `reserved` gives this WQE its WQEBBs [index, index + n).
//   * room: slots are reusable once `retired` passes them. Retirement comes only from CQEs, as with a real mlx5
//     queue, so the unsignaled WQEs that all posters together may have outstanding after the last signaled one
//     must fit in the ring (e.g. each poster signals every k-th WQE and posters x k x 4 WQEBBs <= ring size).
//     Otherwise posters wait for room that never comes, and time out (kStageQpRoom).
//   * turn: the doorbell record must only ever announce fully written WQEs, so posters ring in index order: the
//     one holding [index, index + n) waits until `published == index`. Its release store of the doorbell record
//     (and of `published`) carries the earlier posters' WQE stores along (they released `published` to us).
// Whoever waits also polls the CQ (one thread at a time, by try-lock), so completions are drained without a
// dedicated thread.
//
// Waits go through a Waiter: `w.wait(done, stage)` spins until done() or gives up (false) after its timeout,
// `w.fail(stage)` records a failure that is not a timeout. On the GPU that is wait_until with a WaitCtx
// (device_qp.cuh); on the host a clock-bounded spin (host_waiter.hpp).
#pragma once
#include "../runtime/error_record.cuh"
#include "device_qp_layout.hpp"
#include "wqe_encode.hpp"

namespace dc::transport {

// a - b >= 0 for free-running 32-bit indices
DC_HD bool index_geq(uint32_t a, uint32_t b) { return int32_t(a - b) >= 0; }

// Poll every available CQE unless another thread is doing so; advance `retired`. Returns false on an error CQE
// (counted in the poster state, reported as kStageQpErrorCqe).
template <typename Waiter>
DC_HD bool qp_poll_completions(const DeviceQp& qp, const Waiter& waiter) {
  QpPosterState* st = qp.poster;
  if (cas_acquire_u32(&st->lock, 0u, 1u) != 0u) return true;  // someone else is polling
  uint32_t ci = st->cq_ci, retired = st->retired, seen = 0;
  bool ok = true;
  Completion c;
  while (cq_poll(qp.cq, ci, &c)) {
    ++ci;
    ++seen;
    if (c.cqe_opcode != kCqeReq) {
      if (st->error_cqes++ == 0) st->first_syndrome = c.syndrome;
      ok = false;
      continue;
    }
    // wqe_counter names the (16-bit) first WQEBB of the completed WQE; it retires that WQE and all before it.
    // Its size is still in its control segment: the slot is not reused until `retired` passes it.
    const uint32_t start = retired + uint16_t(c.wqe_counter - uint16_t(retired));
    DecodedWqe w;
    decode_ctrl(qp.sq, start, &w);
    retired = start + w.wqebbs();
  }
  if (seen != 0) {
    st->cq_ci = ci;
    st->cqes_seen += seen;
    cq_set_consumer_index(qp.cq, ci);
    store_release_u32(&st->retired, retired);
  }
  store_release_u32(&st->lock, 0u);
  if (!ok) waiter.fail(kStageQpErrorCqe);
  return ok;
}

// Wait until every WQEBB before `target` has completed (needs a signaled WQE at or after the last one).
template <typename Waiter>
DC_HD bool qp_quiet(const DeviceQp& qp, uint32_t target, const Waiter& waiter) {
  bool error = false;
  const bool done = waiter.wait([&] {
    if (!qp_poll_completions(qp, waiter)) error = true;
    return error || index_geq(load_acquire_u32(&qp.poster->retired), target);
  }, kStageQpQuiet);
  return done && !error;
}

// Reserve n WQEBBs and wait until their slots are free. Returns false on timeout or an error CQE.
template <typename Waiter>
DC_HD bool qp_reserve(const DeviceQp& qp, uint32_t n, uint32_t* index, const Waiter& waiter) {
  *index = fetch_add_relaxed_u32(&qp.poster->reserved, n);
  const uint32_t end = *index + n, size = qp.sq.wqebbs();
  bool error = false;
  const bool room = waiter.wait([&] {
    if (index_geq(load_acquire_u32(&qp.poster->retired) + size, end)) return true;
    if (!qp_poll_completions(qp, waiter)) error = true;
    return error;
  }, kStageQpRoom);
  return room && !error;
}

// Publish [index, index + n) once every earlier WQE is published: doorbell record, doorbell, then `published`.
template <typename Waiter>
DC_HD bool qp_publish(const DeviceQp& qp, uint32_t index, uint32_t n, const Waiter& waiter) {
  if (!waiter.wait([&] { return load_acquire_u32(&qp.poster->published) == index; }, kStageQpTurn)) return false;
  ring_doorbell(qp.db, index + n, qp.sq.qpn);
  store_release_u32(&qp.poster->published, index + n);
  return true;
}

// One post each: the WQE index it got goes to *index (may be null). False on timeout or error CQE.
template <typename Waiter>
DC_HD bool qp_post_write(const DeviceQp& qp, const RdmaWrite& w, const WqeCtrl& c, bool with_imm,
                         const Waiter& waiter, uint32_t* index = nullptr) {
  const uint32_t n = wqebbs_of_ds(kDsRdmaWrite);
  uint32_t i;
  if (!qp_reserve(qp, n, &i, waiter)) return false;
  encode_rdma_write(qp.sq, i, w, c, with_imm);
  if (index != nullptr) *index = i;
  return qp_publish(qp, i, n, waiter);
}

// bytes <= kMaxInlineBytes (callers check); the payload is copied into the WQE now.
template <typename Waiter>
DC_HD bool qp_post_write_inline(const DeviceQp& qp, const void* payload, uint32_t bytes, uint64_t raddr,
                                uint32_t rkey, const WqeCtrl& c, const Waiter& waiter, uint32_t* index = nullptr) {
  const uint32_t n = wqebbs_of_ds(ds_inline_write(bytes));
  uint32_t i;
  if (!qp_reserve(qp, n, &i, waiter)) return false;
  encode_rdma_write_inline(qp.sq, i, payload, bytes, raddr, rkey, c);
  if (index != nullptr) *index = i;
  return qp_publish(qp, i, n, waiter);
}

template <typename Waiter>
DC_HD bool qp_post_fetch_add(const DeviceQp& qp, const FetchAdd& a, const WqeCtrl& c, const Waiter& waiter,
                             uint32_t* index = nullptr) {
  const uint32_t n = wqebbs_of_ds(kDsFetchAdd);
  uint32_t i;
  if (!qp_reserve(qp, n, &i, waiter)) return false;
  encode_fetch_add(qp.sq, i, a, c);
  if (index != nullptr) *index = i;
  return qp_publish(qp, i, n, waiter);
}

// Host or device: what device_qp_init_kernel does, for a queue pair in host memory (all bytes zero on entry).
DC_HD void qp_init_counters(const DeviceQp& qp, uint32_t start) {
  qp.poster->reserved = qp.poster->published = qp.poster->retired = start;
  qp.db.dbrec[kSndDbr] = dbrec_value(start);
}

}  // namespace dc::transport
