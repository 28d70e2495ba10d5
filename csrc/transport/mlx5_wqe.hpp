// The mlx5 send-queue format as a ConnectX NIC reads it. A WQE is a run of 16-byte segments ("ds" counts them)
// laid into 64-byte WQE basic blocks (WQEBBs); every multi-byte field is big-endian.
// Layouts and constants from rdma-core providers/mlx5/mlx5dv.h: struct mlx5_wqe_ctrl_seg, mlx5_wqe_raddr_seg,
// mlx5_wqe_data_seg, mlx5_wqe_atomic_seg, mlx5_wqe_inl_data_seg, MLX5_OPCODE_*, MLX5_WQE_CTRL_*,
// MLX5_SEND_WQE_BB, MLX5_INLINE_SEG, and mlx5dv_set_ctrl_seg() for the packing of the first two words.
#pragma once
#include <cstddef>
#include <cstdint>

#include "mem_ops.hpp"

#if !defined(__CUDA_ARCH__) && defined(__BYTE_ORDER__)
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the WQE words below assume a little-endian host");
#endif

namespace dc::transport {

constexpr uint32_t kWqebbBytes = 64;  // MLX5_SEND_WQE_BB
constexpr uint32_t kWqebbShift = 6;   // MLX5_SEND_WQE_SHIFT
constexpr uint32_t kSegBytes = 16;
constexpr uint32_t kSegsPerWqebb = kWqebbBytes / kSegBytes;
constexpr uint32_t kMaxWqebbsPerWqe = 4;  // our limit (inline writes); a write or an atomic takes one WQEBB

enum Mlx5Opcode : uint8_t {
  kOpNop = 0x00,              // MLX5_OPCODE_NOP
  kOpRdmaWrite = 0x08,        // MLX5_OPCODE_RDMA_WRITE
  kOpRdmaWriteImm = 0x09,     // MLX5_OPCODE_RDMA_WRITE_IMM
  kOpAtomicFetchAdd = 0x12,   // MLX5_OPCODE_ATOMIC_FA: 8-byte fetch-add
};

// The fm_ce_se byte of the control segment.
constexpr uint8_t kCtrlSolicited = 1u << 1;  // MLX5_WQE_CTRL_SOLICITED
constexpr uint8_t kCtrlCqUpdate = 2u << 2;   // MLX5_WQE_CTRL_CQ_UPDATE: this WQE writes a CQE when done
constexpr uint8_t kCtrlFence = 4u << 5;      // MLX5_WQE_CTRL_FENCE

constexpr uint32_t kInlineSegFlag = 0x80000000u;  // MLX5_INLINE_SEG, or-ed into an inline segment's byte count

// Segment layouts (fields hold big-endian values). The encoder writes them as 8-byte words; these structs pin
// the offsets so the words below can be checked against them.
struct CtrlSeg {               // mlx5_wqe_ctrl_seg
  uint32_t opmod_idx_opcode;   // [31:24] opcode modifier, [23:8] WQE index, [7:0] opcode
  uint32_t qpn_ds;             // [31:8] QP number, [7:0] WQE size in 16-byte segments
  uint8_t signature;
  uint8_t rsvd[2];
  uint8_t fm_ce_se;            // fence mode, completion/event mode, solicited event
  uint32_t imm;                // immediate data (RDMA_WRITE_IMM)
};
struct RaddrSeg {              // mlx5_wqe_raddr_seg
  uint64_t raddr;
  uint32_t rkey;
  uint32_t reserved;
};
struct DataSeg {               // mlx5_wqe_data_seg: the local gather entry
  uint32_t byte_count;
  uint32_t lkey;
  uint64_t addr;
};
struct AtomicSeg {             // mlx5_wqe_atomic_seg
  uint64_t swap_add;
  uint64_t compare;
};
static_assert(sizeof(CtrlSeg) == kSegBytes && offsetof(CtrlSeg, qpn_ds) == 4 && offsetof(CtrlSeg, signature) == 8 &&
                  offsetof(CtrlSeg, fm_ce_se) == 11 && offsetof(CtrlSeg, imm) == 12,
              "ctrl segment layout");
static_assert(sizeof(RaddrSeg) == kSegBytes && offsetof(RaddrSeg, rkey) == 8, "raddr segment layout");
static_assert(sizeof(DataSeg) == kSegBytes && offsetof(DataSeg, lkey) == 4 && offsetof(DataSeg, addr) == 8,
              "data segment layout");
static_assert(sizeof(AtomicSeg) == kSegBytes && offsetof(AtomicSeg, compare) == 8, "atomic segment layout");

// Segments per WQE shape: ctrl + raddr + data (write), ctrl + raddr + atomic + data (fetch-add, the data segment
// names where the old value lands), ctrl + raddr + inline header and payload padded to 16 bytes (inline write).
constexpr uint32_t kDsRdmaWrite = 3;
constexpr uint32_t kDsFetchAdd = 4;
constexpr uint32_t kInlineHeaderBytes = 4;  // mlx5_wqe_inl_data_seg
constexpr uint32_t kMaxInlineBytes = kMaxWqebbsPerWqe * kWqebbBytes - 2 * kSegBytes - kInlineHeaderBytes;

DC_HD uint32_t ds_inline_write(uint32_t bytes) { return 2 + (kInlineHeaderBytes + bytes + kSegBytes - 1) / kSegBytes; }
DC_HD uint32_t wqebbs_of_ds(uint32_t ds) { return (ds + kSegsPerWqebb - 1) / kSegsPerWqebb; }

// Host-order values of the packed control words (mlx5dv_set_ctrl_seg). The WQE index is the WQEBB counter of the
// WQE's first block and wraps at 0xffff whatever the ring size.
DC_HD uint32_t pack_opmod_idx_opcode(uint8_t opmod, uint32_t wqe_index, uint8_t opcode) {
  return (uint32_t(opmod) << 24) | ((wqe_index & 0xffffu) << 8) | opcode;
}
DC_HD uint32_t pack_qpn_ds(uint32_t qpn, uint32_t ds) { return ((qpn & 0xffffffu) << 8) | (ds & 0xffu); }

// A big-endian field as the little-endian word that holds its bytes in memory.
DC_HD uint32_t be32(uint32_t v) { return ptx::bswap32(v); }
DC_HD uint64_t be64(uint64_t v) { return ptx::bswap64(v); }
DC_HD uint16_t be16(uint16_t v) { return ptx::bswap16(v); }

}  // namespace dc::transport
