"""Input checks run by Buffer before any communication or kernel.

Every failure raises ``ValueError`` whose message starts with the argument's name (``"topk_idx: ..."``); parts
of the FP8 pair are named ``x[0]`` (values) and ``x[1]`` (scales).

Checks of tensor *values* (expert ids in range, no duplicate experts in a low-latency row) read the data back
to the host; they are skipped while a CUDA graph is being captured, where a host sync is not allowed.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence, Tuple

import torch

from .fp8 import BLOCK
from .handle import Handle, LowLatencyHandle

FP8_DTYPE = torch.float8_e4m3fn
ROW_ALIGN = 8  # non-FP8 hidden must be a multiple of 8 (16-byte bf16 rows)
DATA_ALIGN = 16  # row data is moved in 16-byte vectors: x must start on a 16-byte boundary
MAX_TOPK = 32  # slots per token: the kernels give each a lane of one warp (deepcomm._C.TOPK_MAX, tested equal)


def fail(name: str, message: str):
    raise ValueError(f"{name}: {message}")


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def _values_readable(t: torch.Tensor) -> bool:
    return not (t.is_cuda and is_capturing())


_capture_query = None  # the raw capture query, or a constant False without CUDA (asked once: it costs microseconds)


def is_capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph (the raw query: no Stream object made)."""
    global _capture_query
    if _capture_query is None:
        _capture_query = torch._C._cuda_isCurrentStreamCapturing if torch.cuda.is_available() else (lambda: False)
    return _capture_query()


def check_int(name: str, value, minimum: Optional[int] = None, maximum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        fail(name, f"expected an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        fail(name, f"expected >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        fail(name, f"expected <= {maximum}, got {value}")
    return value


def check_tensor(name: str, t, dtypes: Sequence[torch.dtype], device: torch.device, ndim: int,
                 shape: Optional[Sequence[Optional[int]]] = None) -> torch.Tensor:
    """Type, dtype, device, rank, optional shape (``None`` entries are free) and contiguity."""
    if isinstance(t, torch.Tensor):  # the accepted case first, in few attribute reads: it runs for every tensor
        got = t.shape
        if t.dtype in dtypes and len(got) == ndim and t.is_contiguous() and _on_device(t, device):
            if shape is None:
                return t
            for i in range(min(len(shape), ndim)):  # a plain loop: a generator over zip() costs a microsecond
                if shape[i] is not None and got[i] != shape[i]:
                    break
            else:
                return t
    _check_tensor_slowly(name, t, dtypes, device, ndim, shape)
    return t


def _check_tensor_slowly(name: str, t, dtypes: Sequence[torch.dtype], device: torch.device, ndim: int,
                         shape: Optional[Sequence[Optional[int]]]) -> None:
    """check_tensor's checks one by one, raising for the first that fails."""
    if not isinstance(t, torch.Tensor):
        fail(name, f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        fail(name, f"expected {_dtype_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if not _on_device(t, device):
        fail(name, f"expected a tensor on {device}, got one on {t.device}")
    if t.dim() != ndim:
        fail(name, f"expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None:
        got = t.shape
        for i in range(min(len(shape), len(got))):
            if shape[i] is not None and got[i] != shape[i]:
                want = tuple("*" if s is None else s for s in shape)
                fail(name, f"expected shape {want}, got {tuple(got)}".replace("'*'", "*"))
    if not t.is_contiguous():
        fail(name, "expected a contiguous tensor")


def _on_device(t: torch.Tensor, device: torch.device) -> bool:
    # on CUDA, is_cuda and get_device() (an int) are much cheaper than making and comparing torch.device objects
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return t.is_cuda and t.get_device() == index
    return t.device == device


def check_aligned(name: str, t: torch.Tensor) -> None:
    """Row data (x of every call) starts on a 16-byte boundary: a view at an odd offset of a larger tensor does
    not, and would fault the vector loads of a kernel (every backend takes the same inputs)."""
    if t.data_ptr() % DATA_ALIGN:
        fail(name, f"data must start on a {DATA_ALIGN}-byte boundary (a view at an odd offset? pass a copy)")


def check_num_experts(num_experts, world_size: int) -> int:
    if num_experts is None:
        fail("num_experts", "required when no handle is given")
    check_int("num_experts", num_experts, minimum=1)
    if num_experts % world_size != 0:
        fail("num_experts", f"{num_experts} is not a multiple of the world size {world_size}")
    return num_experts


def check_topk_idx(topk_idx, num_tokens: int, num_experts: int, device: torch.device,
                   forbid_duplicates: bool = False, check_values: bool = True) -> torch.Tensor:
    """``check_values=False`` leaves the id range to a backend that checks it on the device without a sync."""
    if topk_idx is None:
        fail("topk_idx", "required when no handle is given")
    check_tensor("topk_idx", topk_idx, (torch.int64,), device, 2, (num_tokens, None))
    if topk_idx.shape[1] > MAX_TOPK:
        fail("topk_idx", f"at most {MAX_TOPK} slots per token, got {topk_idx.shape[1]}")
    if check_values and topk_idx.numel() and _values_readable(topk_idx):
        # One device-to-host read for all value checks (each read is a sync on a GPU).
        stats = [topk_idx.min(), topk_idx.max()]
        dup_rows = None
        if forbid_duplicates and topk_idx.shape[1] > 1:
            ordered = topk_idx.sort(dim=1).values
            dup_rows = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any(dim=1)
            # first offending row, or -1
            first = torch.where(dup_rows, torch.arange(dup_rows.numel(), device=dup_rows.device),
                                torch.full_like(dup_rows, dup_rows.numel(), dtype=torch.int64)).min()
            stats.append(first)
        values = torch.stack(stats).tolist()
        lo, hi = values[0], values[1]
        if lo < -1:
            fail("topk_idx", f"expert ids must be >= -1, found {lo}")
        if hi >= num_experts:
            fail("topk_idx", f"expert ids must be < num_experts={num_experts}, found {hi}")
        if dup_rows is not None and values[2] < dup_rows.numel():
            fail("topk_idx", f"row {values[2]} names the same expert twice")
    return topk_idx


def routing_accepted(topk_idx, topk_weights, num_tokens: int, num_experts, world_size: int,
                     device: torch.device) -> bool:
    """Whether a fresh dispatch's num_experts, topk_idx and topk_weights pass check_num_experts, check_topk_idx
    (values left to the device) and check_topk_weights, in one pass over plain tensors: the accepted case of every
    fresh dispatch. False sends the caller through those checks, which name what is wrong."""
    if type(num_experts) is not int or num_experts < 1 or num_experts % world_size:
        return False
    if type(topk_idx) is not torch.Tensor:
        return False
    got = topk_idx.shape
    if (topk_idx.dtype != torch.int64 or len(got) != 2 or got[0] != num_tokens or got[1] > MAX_TOPK
            or not topk_idx.is_contiguous() or not _on_device(topk_idx, device)):
        return False
    return topk_weights is None or (
        type(topk_weights) is torch.Tensor and topk_weights.dtype == torch.float32 and topk_weights.shape == got
        and topk_weights.is_contiguous() and _on_device(topk_weights, device))


def check_topk_weights(topk_weights, shape: Sequence[Optional[int]], device: torch.device,
                       name: str = "topk_weights") -> torch.Tensor:
    return check_tensor(name, topk_weights, (torch.float32,), device, 2, shape)


def check_hidden(name: str, hidden: int, multiple: int, max_hidden: int) -> None:
    if hidden % multiple != 0:
        fail(name, f"hidden size {hidden} must be a multiple of {multiple}")
    if hidden > max_hidden:
        fail(name, f"hidden size {hidden} exceeds the Buffer's hidden={max_hidden}; create the Buffer "
                   f"with hidden >= {hidden}")


def check_num_tokens(name: str, num_tokens: int, maximum: int, what: str) -> None:
    if num_tokens > maximum:
        fail(name, f"{num_tokens} tokens exceed {what}={maximum}")


def check_dispatch_x(x, device: torch.device, dtypes: Sequence[torch.dtype], max_hidden: int,
                     max_tokens: int) -> Tuple[int, int, bool]:
    """``x`` of a normal dispatch: a tensor ``[T, H]`` or an FP8 pair. Returns ``(T, H, is_fp8)``."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            fail("x", f"an FP8 input must be a (values, scales) pair, got {len(x)} items")
        values, scales = x
        check_tensor("x[0]", values, (FP8_DTYPE,), device, 2)
        check_aligned("x[0]", values)
        num_tokens, hidden = values.shape
        check_hidden("x[0]", hidden, BLOCK, max_hidden)
        check_fp8_scales("x[1]", scales, num_tokens, hidden, device)
        check_num_tokens("x[0]", num_tokens, max_tokens, "max_tokens_per_rank")
        return num_tokens, hidden, True
    if isinstance(x, torch.Tensor):  # the accepted case in one pass (every call); else the checks one by one
        got = x.shape
        if (x.dtype in dtypes and x.dtype != FP8_DTYPE and len(got) == 2 and got[1] % ROW_ALIGN == 0
                and got[1] <= max_hidden and got[0] <= max_tokens and x.is_contiguous()
                and x.data_ptr() % DATA_ALIGN == 0 and _on_device(x, device)):
            return got[0], got[1], False
        if x.dtype == FP8_DTYPE:
            fail("x", "float8_e4m3fn input must be passed as a (values, scales) pair")
    check_tensor("x", x, dtypes, device, 2)
    check_aligned("x", x)
    num_tokens, hidden = x.shape
    check_hidden("x", hidden, ROW_ALIGN, max_hidden)
    check_num_tokens("x", num_tokens, max_tokens, "max_tokens_per_rank")
    return num_tokens, hidden, False


def check_fp8_scales(name: str, scales, num_tokens: int, hidden: int, device: torch.device) -> None:
    """fp32 ``[T, H/128]`` or UE8M0-packed int32 ``[T, H/512]``."""
    check_tensor(name, scales, (torch.float32, torch.int32), device, 2)
    if scales.dtype == torch.float32:
        want = (num_tokens, hidden // BLOCK)
    else:
        if hidden % (4 * BLOCK) != 0:
            fail(name, f"packed UE8M0 scales need a hidden size that is a multiple of 512, got {hidden}")
        want = (num_tokens, hidden // (4 * BLOCK))
    if tuple(scales.shape) != want:
        fail(name, f"expected shape {want} for {str(scales.dtype).replace('torch.', '')} scales, "
                   f"got {tuple(scales.shape)}")


def check_handle(handle, cls: type, buffer_id: int) -> None:
    if not isinstance(handle, cls):
        fail("handle", f"expected a deepcomm.{cls.__name__}, got {type(handle).__name__}")
    if handle.buffer_id != buffer_id:
        fail("handle", f"made by Buffer {handle.buffer_id}, not by this Buffer ({buffer_id})")


def check_combine_x(x, handle: Handle, device: torch.device, dtypes: Sequence[torch.dtype],
                    max_hidden: int, use_fp8: bool = False) -> None:
    """``use_fp8``: the FP8 combine casts bf16 rows per 128-element block, so it takes bf16 with H % 128 == 0."""
    if use_fp8 is False and type(x) is torch.Tensor:  # the accepted case in one pass (every call)
        got = x.shape
        if (x.dtype in dtypes and len(got) == 2 and got[0] == handle.num_recv and got[1] % ROW_ALIGN == 0
                and got[1] <= max_hidden and x.is_contiguous() and x.data_ptr() % DATA_ALIGN == 0
                and _on_device(x, device)):
            return
    if not isinstance(use_fp8, bool):
        fail("use_fp8", f"expected a bool, got {type(use_fp8).__name__}")
    if isinstance(x, (tuple, list)):
        fail("x", "combine takes a tensor, not an FP8 pair")
    check_tensor("x", x, (torch.bfloat16,) if use_fp8 else dtypes, device, 2)
    check_aligned("x", x)
    if x.shape[0] != handle.num_recv:
        fail("x", f"expected {handle.num_recv} rows (handle.num_recv), got {x.shape[0]}")
    check_hidden("x", x.shape[1], BLOCK if use_fp8 else ROW_ALIGN, max_hidden)


def check_low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                               use_ue8m0, world_size: int, device: torch.device, max_hidden: int,
                               max_low_latency_tokens: int, check_values: bool = True) -> None:
    """``check_values=False``: the backend checks expert ids (range, duplicates) on the device, without a sync."""
    check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, minimum=1,
              maximum=max_low_latency_tokens)
    check_num_experts(num_experts, world_size)
    if not isinstance(use_fp8, bool):
        fail("use_fp8", f"expected a bool, got {type(use_fp8).__name__}")
    if not isinstance(use_ue8m0, bool):
        fail("use_ue8m0", f"expected a bool, got {type(use_ue8m0).__name__}")
    if use_ue8m0 and not use_fp8:
        fail("use_ue8m0", "requires use_fp8=True")
    check_tensor("x", x, (torch.bfloat16,), device, 2)
    check_aligned("x", x)
    num_tokens, hidden = x.shape
    check_hidden("x", hidden, BLOCK, max_hidden)
    check_num_tokens("x", num_tokens, num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank")
    check_topk_idx(topk_idx, num_tokens, num_experts, device, forbid_duplicates=True, check_values=check_values)


def check_low_latency_combine(x, topk_idx, topk_weights, handle: LowLatencyHandle, world_size: int,
                              device: torch.device, max_hidden: int) -> None:
    experts_per_rank = handle.num_experts // world_size
    rows = world_size * handle.num_max_dispatch_tokens_per_rank
    check_tensor("x", x, (torch.bfloat16,), device, 3, (experts_per_rank, rows, None))
    check_aligned("x", x)
    check_hidden("x", x.shape[2], ROW_ALIGN, max_hidden)
    check_tensor("topk_idx", topk_idx, (torch.int64,), device, 2, tuple(handle.recv_pos.shape))
    check_topk_weights(topk_weights, tuple(handle.recv_pos.shape), device)
