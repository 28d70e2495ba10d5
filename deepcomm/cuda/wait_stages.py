"""What each number a kernel writes into an error record means, in words. The numbers are enum WaitStage
(csrc/runtime/error_record.cuh), exported by the extension as ``WAIT_STAGES`` (name -> number); the text here is
keyed by those names."""
from __future__ import annotations

import functools
from typing import Dict, Optional

# Timeouts: the wait that gave up.
STAGE_TEXT = {
    "notify_counts": "notify:counts",
    "dispatch_mailbox": "dispatch:mailbox",
    "dispatch_done": "dispatch:done",
    "combine_ready": "combine:ready",
    "combine_token": "combine:token",
    "barrier": "barrier",
    "ll_counts": "low_latency_dispatch:counts",  # retired (kept so the numbers stay stable)
    "ll_dispatch_data": "low_latency_dispatch:data",
    "ll_combine_data": "low_latency_combine:data",
    "ll_combine_weights": "low_latency_combine:weights",
    "agree": "agree (waiting for a peer's call fingerprint: it has not reached this call)",
    "notify_local": "notify:local (this dispatch's own notify phase did not finish)",
    "qp_room": "qp:room (send queue full, no completions)",
    "qp_turn": "qp:turn (an earlier post never rang the doorbell)",
    "qp_quiet": "qp:quiet (posted WQEs not completed)",
    "nic_doorbell": "nic:doorbell (device NIC waiting for WQEs)",
    "qp_error_cqe": "qp:error_cqe (a WQE completed with an error)",
    "qp_signal": "qp:signal (waiting for a peer's fetch-add signal)",
    "internode_credit": "internode:credit (a peer has not freed its receive slot for us)",
    "nvshmem_credit": "nvshmem:credit (a peer has not freed its receive slot for us)",
    "nvshmem_signal": "nvshmem:signal (a peer's block for us has not landed)",
    "node_barrier": "node:barrier (a GPU of our node has not reached the NVLink hop's barrier)",
    "hier_free": "hier:free (a GPU of our node has not freed its area for this call's rows)",
    "hier_arrive": "hier:arrive (a GPU of our node has not finished putting its rows into our area)",
    "hier_local": "hier:local (this call's own blocks did not finish packing or reducing)",
}
# Input problems found on the device (not timeouts): every rank stopped the call consistently. Formatted with
# ``peer``, ``peer_or_some`` ("some rank" when the record names none) and ``count`` (the record's waited_ns field,
# which holds a count for the stages whose text names one).
INPUT_ERROR_TEXT = {
    "invalid_ids": "topk_idx: expert ids outside [-1, num_experts) on rank {peer_or_some}; nothing was dispatched",
    "overflow": "num_worst_tokens: rank {peer} receives more rows than num_worst_tokens; rows past it were dropped",
    # low-latency dispatch checks on the device and raises at the next call, hook or synchronize()
    "ll_invalid_ids": "topk_idx: an earlier low_latency_dispatch on rank {peer} had expert ids outside "
                      "[-1, num_experts); those slots were dropped (sent nowhere)",
    "ll_duplicate_ids": "topk_idx: an earlier low_latency_dispatch on rank {peer} had a token naming the same "
                        "expert twice",
    # get_dispatch_layout checks on the device (local, no host sync) and raises at the next call or synchronize()
    "layout_invalid_ids": "topk_idx: an earlier get_dispatch_layout on rank {peer} had {count} expert ids outside "
                          "[-1, num_experts); they counted nowhere (its num_tokens_per_rank, num_tokens_per_expert "
                          "and is_token_in_rank leave those slots out)",
    # the ranks' call fingerprints differed: the text comes from the AgreeRecord (deepcomm/cuda/agree_record.py);
    # this one only when that record is missing
    "disagree": "fingerprint: an earlier call disagreed with rank {peer_or_some}'s; no rank ran it",
}


@functools.lru_cache(maxsize=None)
def _by_number(C, table: str) -> Dict[int, str]:
    text = STAGE_TEXT if table == "stages" else INPUT_ERROR_TEXT
    return {number: text[name] for name, number in C.WAIT_STAGES.items() if name in text}


def stage_text(C, stage: int) -> str:
    """The words for timeout stage ``stage`` of extension ``C`` ("stage N" for a number it does not name)."""
    return _by_number(C, "stages").get(stage, f"stage {stage}")


def input_error_text(C, stage: int) -> Optional[str]:
    """The message template of input-error stage ``stage``, or None when ``stage`` is not an input error."""
    return _by_number(C, "input").get(stage)
