"""A plain normal-mode call's arguments checked and read in C++ (deepcomm._C.DispatchArgReader,
csrc/bindings/dispatch_args.cpp): one crossing in place of the Buffer's checks, the fingerprint and the backend's
reads of the tensors, for the fresh dispatches, cached dispatches and combines every training step makes. torch
describes each tensor to it through its DLPack C exchange table (``torch.Tensor.__dlpack_c_exchange_api__``, torch
2.10 and later); without one the reader is off. The reader is given the limits of deepcomm/validation.py and the
fingerprint layout of deepcomm/agreement.py here, so both stay defined in one place; it accepts only what those
checks accept (None otherwise: the Buffer's Python path then runs them and names what is wrong)."""
from __future__ import annotations

import torch

from .. import agreement
from .. import validation as v
from ..fp8 import BLOCK
from .dlpack_table import exchange_api

READ_DTYPES = ("bfloat16", "float8_e4m3fn", "float32", "int32", "int64")


def dispatch_arg_reader(C, world_size: int, device_index: int, max_hidden: int, max_tokens: int,
                        current_stream=None):
    """The reader of one Buffer, or None without torch's exchange table: its world size, its CUDA device (-1:
    tensors on the CPU, for tests, never captured), the largest hidden size and token count it takes, and a query
    of the caller's raw stream by device index (None: torch's own, through the table; 0 on the CPU without one).
    Each method returns None (the Python checks then run) or what the backend's ``dispatch_read`` /
    ``combine_read`` take:
    ``fresh(x, topk_idx, topk_weights, num_experts, call, buffer)`` and ``cached(x, topk_weights, num_tokens,
    num_experts, handle_call, call, buffer)`` -> ``(T, H, K, caller stream, x dtype, scales dtype or None,
    x_row_bytes, scale_row_bytes, x ptr, scales ptr, topk_idx ptr, topk_weights ptr, with weights, fingerprint)``;
    ``combine(x, topk_weights, num_recv, use_fp8, handle_call, call, buffer)`` -> ``(N, H, K, caller stream, x ptr,
    topk_weights ptr, with weights, use_fp8, fingerprint)``."""
    api = exchange_api()
    if api is None:
        return None
    limits = {"num_ranks": world_size, "device": device_index, "max_hidden": max_hidden, "max_tokens": max_tokens,
              "row_align": v.ROW_ALIGN, "data_align": v.DATA_ALIGN, "max_topk": v.MAX_TOPK, "block": BLOCK}
    layout = {"words": agreement.WORDS, "magic": agreement.MAGIC, "call_mask": agreement.CALL_MASK,
              "op_dispatch": int(agreement.Op.DISPATCH), "op_combine": int(agreement.Op.COMBINE),
              "at": {w.name: int(w) for w in agreement.Word},
              "bf16_code": agreement.DTYPE_CODES[torch.bfloat16],
              "fp8_code": agreement.DTYPE_CODES[torch.float8_e4m3fn],
              "scales_fp32": agreement.SCALES_FP32, "scales_ue8m0": agreement.SCALES_UE8M0}
    samples = {name: torch.empty(0, dtype=getattr(torch, name)) for name in READ_DTYPES}
    try:
        return C.DispatchArgReader(api, torch.Tensor, samples, limits, layout, current_stream)
    except ValueError:  # a table of another major version, or one that cannot describe a dtype the calls use
        return None
