// The poster's side of a device queue pair, run by GPU threads: reserve WQEBBs, encode the WQE with the same
// encoders as the host, publish in reservation order (doorbell record then doorbell, release ordering), and
// retire slots from CQEs. Any number of threads of any blocks may post to one queue concurrently.
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
// dedicated thread. Every wait is a wait_until: a timeout records (rank, peer, stage) and the post returns false.
#pragma once
#include "../runtime/wait.cuh"
#include "device_qp_layout.hpp"
#include "wqe_encode.hpp"

namespace dc::transport {

__device__ __forceinline__ uint32_t qp_load(const uint32_t* p) { return ptx::ld_acquire_sys_u32(p); }
__device__ __forceinline__ void qp_store(uint32_t* p, uint32_t v) { ptx::st_release_sys_u32(p, v); }
// a - b >= 0 for free-running 32-bit indices
__device__ __forceinline__ bool index_geq(uint32_t a, uint32_t b) { return int32_t(a - b) >= 0; }

// Poll every available CQE if no other thread is doing so; advance `retired`. Returns false on an error CQE
// (recorded in the poster state and in the wait context as kStageQpErrorCqe).
__device__ inline bool qp_poll_completions(const DeviceQp& qp, const WaitCtx& ctx, int peer) {
  QpPosterState* st = qp.poster;
  if (ptx::atom_cas_acquire_sys_u32(&st->lock, 0u, 1u) != 0u) return true;  // someone else is polling
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
    // Its size is still in its control segment: the slot is not reusable until `retired` passes it.
    const uint32_t start = retired + uint16_t(c.wqe_counter - uint16_t(retired));
    DecodedWqe w;
    decode_ctrl(qp.sq, start, &w);
    retired = start + w.wqebbs();
  }
  if (seen != 0) {
    st->cq_ci = ci;
    st->cqes_seen += seen;
    cq_set_consumer_index(qp.cq, ci);
    qp_store(&st->retired, retired);
  }
  qp_store(&st->lock, 0u);
  if (!ok) report_input_error(ctx, peer, kStageQpErrorCqe);
  return ok;
}

// Wait until every WQEBB before `target` has completed (needs a signaled WQE at or after the last one).
__device__ inline bool qp_quiet(const DeviceQp& qp, uint32_t target, const WaitCtx& ctx, int peer) {
  bool error = false;
  const bool done = wait_until([&] {
    if (!qp_poll_completions(qp, ctx, peer)) error = true;
    return error || index_geq(qp_load(&qp.poster->retired), target);
  }, ctx, peer, kStageQpQuiet);
  return done && !error;
}

// Reserve n WQEBBs and wait until their slots are free. Returns false on timeout or an error CQE.
__device__ inline bool qp_reserve(const DeviceQp& qp, uint32_t n, uint32_t* index, const WaitCtx& ctx, int peer) {
  *index = atomicAdd(&qp.poster->reserved, n);
  const uint32_t end = *index + n, size = qp.sq.wqebbs();
  bool error = false;
  const bool room = wait_until([&] {
    if (index_geq(qp_load(&qp.poster->retired) + size, end)) return true;
    if (!qp_poll_completions(qp, ctx, peer)) error = true;
    return error;
  }, ctx, peer, kStageQpRoom);
  return room && !error;
}

// Publish [index, index + n) once every earlier WQE is published: doorbell record, doorbell, then `published`.
__device__ inline bool qp_publish(const DeviceQp& qp, uint32_t index, uint32_t n, const WaitCtx& ctx, int peer) {
  if (!wait_until([&] { return qp_load(&qp.poster->published) == index; }, ctx, peer, kStageQpTurn)) return false;
  ring_doorbell(qp.db, index + n, qp.sq.qpn);
  qp_store(&qp.poster->published, index + n);
  return true;
}

// One post each: the WQE index it got goes to *index (may be null). False on timeout or error CQE.
__device__ inline bool qp_post_write(const DeviceQp& qp, const RdmaWrite& w, const WqeCtrl& c, bool with_imm,
                                     const WaitCtx& ctx, int peer, uint32_t* index = nullptr) {
  const uint32_t n = wqebbs_of_ds(kDsRdmaWrite);
  uint32_t i;
  if (!qp_reserve(qp, n, &i, ctx, peer)) return false;
  encode_rdma_write(qp.sq, i, w, c, with_imm);
  if (index != nullptr) *index = i;
  return qp_publish(qp, i, n, ctx, peer);
}

// bytes <= kMaxInlineBytes (callers check); the payload is copied into the WQE now.
__device__ inline bool qp_post_write_inline(const DeviceQp& qp, const void* payload, uint32_t bytes, uint64_t raddr,
                                            uint32_t rkey, const WqeCtrl& c, const WaitCtx& ctx, int peer,
                                            uint32_t* index = nullptr) {
  const uint32_t n = wqebbs_of_ds(ds_inline_write(bytes));
  uint32_t i;
  if (!qp_reserve(qp, n, &i, ctx, peer)) return false;
  encode_rdma_write_inline(qp.sq, i, payload, bytes, raddr, rkey, c);
  if (index != nullptr) *index = i;
  return qp_publish(qp, i, n, ctx, peer);
}

__device__ inline bool qp_post_fetch_add(const DeviceQp& qp, const FetchAdd& a, const WqeCtrl& c, const WaitCtx& ctx,
                                         int peer, uint32_t* index = nullptr) {
  const uint32_t n = wqebbs_of_ds(kDsFetchAdd);
  uint32_t i;
  if (!qp_reserve(qp, n, &i, ctx, peer)) return false;
  encode_fetch_add(qp.sq, i, a, c);
  if (index != nullptr) *index = i;
  return qp_publish(qp, i, n, ctx, peer);
}

}  // namespace dc::transport
