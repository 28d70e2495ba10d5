"""torch's DLPack C exchange table (``torch.Tensor.__dlpack_c_exchange_api__``, torch 2.10 and later): a capsule of
torch's own functions that describe its tensors to C++ and make tensors from C++ without Python in between. The
arena's views (deepcomm/cuda/arena.py), the argument reader of plain calls (deepcomm/cuda/arg_reader.py) and the
operators' owned views (deepcomm/cuda/owned_views.py) use it where it is there (csrc/bindings/exchange_table.hpp
checks its version). Also the DLPack element types those views are made of."""
from __future__ import annotations

import torch


# DLPack (type code, bits) of the dtypes deepcomm's views are made of (the arena's outputs, the operators' routing
# tensors). FP8 is DLPack's float8_e4m3fn code, which older torch does not read (deepcomm/cuda/arena.py probes it).
DLPACK_TYPES = {torch.bfloat16: (4, 16), torch.float32: (2, 32), torch.int64: (0, 64), torch.int32: (0, 32),
                torch.int16: (0, 16), torch.uint8: (1, 8), torch.bool: (6, 8), torch.float8_e4m3fn: (10, 8)}


def exchange_api():
    """torch's DLPack C exchange table (a capsule), or None where this torch has none."""
    return getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
