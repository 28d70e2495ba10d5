"""Row sizes of the internode path (either RDMA transport and the NVLink hop): the widest row each hop carries and
the receive slot of one rail rank, as the extension describes them (InternodeRows, csrc/runtime/
internode_layout.hpp); read once per argument tuple (internode_layout.rows)."""
from __future__ import annotations

from .internode_layout import extension, rows

# Bytes at the front of every rail block of a call's first RDMA exchange, and of every section the kernels send:
# the call's fingerprint, agreement.WORDS int32 words (hier_agree.py; zeros where nothing is compared).
RAIL_HEADER_BYTES: int = extension().RAIL_HEADER_BYTES
# With several GPUs per node a combine's rail header carries the words of every GPU of its node, and on the torch
# routing every first exchange's header has a slot per GPU of the node (hier_agree.py): up to this many headers,
# which every receive slot has room for.
MAX_NODE_HEADERS: int = extension().MAX_NODE_HEADERS


def max_node_row_bytes(hidden: int) -> int:
    """Widest row the NVLink hop carries: a dispatch row of bf16 x (FP8 values + scales are narrower), int64
    top-k ids, fp32 top-k weights, an int32 source index and an int32 node mask, padded to 16 bytes (combine
    rows, bf16 x + weights + source index, are narrower)."""
    return rows(0, hidden)["node_row"]


def max_row_bytes(hidden: int) -> int:
    """Widest row an RDMA exchange carries: a dispatch row, or a combine partial of several rows (fp32 x and
    fp32 weights)."""
    return rows(0, hidden)["rail_row"]


def rail_slot_bytes(max_tokens: int, hidden: int) -> int:
    """Bytes of one receive slot of the RDMA hop, for either transport: a rail rank sends us at most one row per
    token of its own (dispatch: each token once per node; combine: one partial per (token, node)), each at most
    ``max_row_bytes`` (the fp32 partial is the widest), after the block's header (``RAIL_HEADER_BYTES``, or one per
    GPU of the node in a combine: ``MAX_NODE_HEADERS``), 64-byte aligned."""
    return rows(max_tokens, hidden)["slot"]
