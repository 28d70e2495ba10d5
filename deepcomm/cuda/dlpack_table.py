"""torch's DLPack C exchange table (``torch.Tensor.__dlpack_c_exchange_api__``, torch 2.10 and later): a capsule of
torch's own functions that describe its tensors to C++ and make tensors from C++ without Python in between. The
arena's views (deepcomm/cuda/arena.py) and the argument reader of plain calls (deepcomm/cuda/arg_reader.py) use it
where it is there (csrc/bindings/exchange_table.hpp checks its version)."""
from __future__ import annotations

import torch


def exchange_api():
    """torch's DLPack C exchange table (a capsule), or None where this torch has none."""
    return getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
