// A fresh internode dispatch's route, as one kernel writes it (kernels/hier_route.hpp) into one int32 workspace:
//   send_pos  int32 [T, R]  index of token t among the tokens we send to rank r, -1 if none
//   rdma_slot int32 [T, N]  index of token t among the tokens we send to node m, -1 if none      (G > 1 only)
//   masks     int32 [T, N]  bit g set when GPU g of node m holds an expert of token t            (G > 1 only)
//   held_slot int32 [T, N]  where the combine finds token t's partial from node m in that node's block
//                           (G > 1 only): node m holds t on one GPU: k >= 0, t's index among such tokens (the
//                           holder's row comes back as held); on several: -(index among those) - 1 (an fp32
//                           partial, after the held rows); on none: -1
//   one_held  int32 [N]     tokens node m holds on exactly one GPU                               (G > 1 only)
//   row       int32 [width] what the count round sends every rank (HierCountRow)
//   in_rank   bool  [T, R]  token t has an expert on rank r, in whole int32 elements
// With one GPU per node a node is a rank: the rdma slots are the send positions (and the held slots too: a node
// holds a token on its one GPU or not at all), and the masks are not used.
// deepcomm/internode/hier_route.py views the workspace through the extension's hier_route_work.
#pragma once
#include <cstdint>

#include "agree_record.hpp"
#include "host_device.hpp"
#include "nvl_layout.hpp"

namespace dc {

// The count round's row of one rank (int32 offsets into the row):
//   words   [kFingerprintWords]  the call's words                                    (with words only)
//   ranks   [R]                  tokens we send to each rank
//   nodes   [N]                  tokens we send to each node                          (G > 1 only)
//   experts [E]                  tokens naming each expert (once per token)
//   bad     [1]                  our expert ids outside [-1, E)
// zeros up to a multiple of 4 values (the count round sends whole 16-byte rows).
struct HierCountRow {
  int64_t words, ranks, nodes, experts, bad, width;
  DC_HD HierCountRow(int ranks_, int gpus, int64_t num_experts, bool with_words) {
    words = 0;
    ranks = with_words ? kFingerprintWords : 0;
    nodes = ranks + ranks_;
    experts = nodes + (gpus > 1 ? ranks_ / gpus : 0);
    bad = experts + num_experts;
    width = align_up(bad + 1, 4);
  }
};

struct HierRouteWork {
  int64_t send_pos, rdma_slot, masks, held_slot, one_held, row, in_rank, total;
  HierCountRow count_row;
  DC_HD HierRouteWork(int64_t tokens, int ranks, int gpus, int64_t num_experts, bool with_words)
      : count_row(ranks, gpus, num_experts, with_words) {
    const int64_t nodes = gpus > 1 ? ranks / gpus : 0;
    send_pos = 0;
    rdma_slot = align_up(tokens * ranks, 4);
    masks = rdma_slot + tokens * nodes;
    held_slot = masks + tokens * nodes;
    one_held = held_slot + tokens * nodes;
    row = align_up(one_held + nodes, 4);  // 16-byte aligned: the count round sends it as it is
    in_rank = row + count_row.width;
    total = in_rank + (tokens * ranks + 3) / 4;
  }
};

}  // namespace dc
