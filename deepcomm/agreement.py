"""What every rank must agree on in one collective call: the call's fingerprint, and the check of everyone's.

The kernels and the reference backend assume that every rank of a Buffer makes the same collective calls in the same
order with the same call-wide arguments (only the token count may differ per rank). A fingerprint is those
arguments as ``WORDS`` int32 words; each call exchanges it in the first fixed-size exchange the call makes, and every
rank runs ``check`` on every rank's words before any row is used. A disagreement raises ``ValueError`` on every rank,
with the same text everywhere: the argument, each rank's value, and that no rank ran the call. A rank whose own
validation failed takes part in that exchange all the same, with its ``REJECTED`` word set, so the others raise
naming it instead of pairing the exchange with its next call.

Word layout (int32, in this order; the CUDA kernels carry the same words, so this table and ``Word`` are the one
definition of it):

  word  name           value
  0     MAGIC          ``MAGIC`` (0x44430001: "DC", layout version 1); anything else is not a fingerprint of ours
  1     OP             ``Op``: 1 dispatch, 2 combine, 3 low_latency_dispatch, 4 low_latency_combine
  2     CALL           this call's number on this Buffer: 1, 2, ... (every collective call counts, rejected ones
                       too), modulo 2**31
  3     BUFFER         the Buffer's number in its group + 1 (the same on every rank; 0 where no store numbered it)
  4     REJECTED       0: accepted; else this rank's own validation raised, and the value names the argument its
                       error named: ``1 + REJECT_ARGS.index(name)``, or ``REJECT_OTHER`` when it named none of them
                       (words 5-15 are then 0)
  5     HIDDEN         x's hidden size (normal: x.shape[1], of the values for an FP8 pair; low-latency combine:
                       x.shape[2])
  6     X_DTYPE        ``DTYPE_CODES`` of x (of the values for an FP8 pair): 1 bfloat16, 2 float16, 3 float32,
                       4 float64, 5 float8_e4m3fn
  7     SCALES         normal dispatch's FP8 scale format: 0 none, 1 fp32 per 128 values, 2 UE8M0 packed int32
  8     TOPK           slots per token that travel: topk_idx.shape[1] (fresh dispatch, low-latency calls), else
                       topk_weights.shape[1] (cached dispatch, combine), 0 without weights there
  9     WEIGHTS        1 when topk_weights is given (always 1 in low-latency combine)
  10    NUM_EXPERTS    num_experts (dispatch calls; of the handle for a cached dispatch), 0 in combine calls
  11    HANDLE         which handle: the CALL number of the dispatch that made it; 0 for a fresh dispatch
  12    LL_MAX_TOKENS  num_max_dispatch_tokens_per_rank (low_latency_dispatch), 0 elsewhere
  13    USE_FP8        use_fp8 (low_latency_dispatch, combine, low_latency_combine), 0 in normal dispatch
  14    USE_UE8M0      use_ue8m0 (low_latency_dispatch), 0 elsewhere
  15    NUM_SMS        the Buffer's num_sms (dispatch, combine: the kernels pair their blocks across ranks by it),
                       0 in low-latency calls

May differ per rank: the token count, ``expert_alignment``, ``num_worst_tokens``, ``previous_event``,
``async_finish``, ``return_recv_hook`` (its send and receive halves are the same kernels), the values in the tensors.

A backend takes part with ``capabilities.takes_fingerprints`` (backend_protocol.py); Buffer then passes
``fingerprint=<words>`` to its ``dispatch``, ``combine``, ``low_latency_dispatch`` and ``low_latency_combine``,
and calls its ``reject(words)`` for a call this rank rejected before handing it over (the backend joins that call's first exchange with those words and
returns; Buffer raises the rank's own error). Every kind of call must start with an exchange of the same fixed
size, so that any two calls that meet pair up safely: the reference backend's is an all_gather of ``WORDS + R``
int32 (the words, then a fresh dispatch's rows per destination rank, zeros in the other calls).
"""
from __future__ import annotations

import enum
from typing import Dict, List, Optional, Sequence, Tuple

import torch

WORDS = 16
MAGIC = 0x44430001
CALL_MASK = 0x7FFFFFFF  # CALL and HANDLE words wrap at 2**31 (they are int32 on the device)


class Word(enum.IntEnum):
    MAGIC = 0
    OP = 1
    CALL = 2
    BUFFER = 3
    REJECTED = 4
    HIDDEN = 5
    X_DTYPE = 6
    SCALES = 7
    TOPK = 8
    WEIGHTS = 9
    NUM_EXPERTS = 10
    HANDLE = 11
    LL_MAX_TOKENS = 12
    USE_FP8 = 13
    USE_UE8M0 = 14
    NUM_SMS = 15


class Op(enum.IntEnum):
    DISPATCH = 1
    COMBINE = 2
    LOW_LATENCY_DISPATCH = 3
    LOW_LATENCY_COMBINE = 4


OP_CODES: Dict[str, int] = {op.name.lower(): int(op) for op in Op}  # "dispatch" -> 1, ...
OP_NAMES: Dict[int, str] = {code: name for name, code in OP_CODES.items()}

DTYPE_CODES: Dict[torch.dtype, int] = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float64: 4,
                                       torch.float8_e4m3fn: 5}
DTYPE_NAMES: Dict[int, str] = {code: str(d).replace("torch.", "") for d, code in DTYPE_CODES.items()}
SCALES_NONE, SCALES_FP32, SCALES_UE8M0 = 0, 1, 2
SCALE_NAMES = {SCALES_NONE: "none", SCALES_FP32: "fp32 (one per 128 values)",
               SCALES_UE8M0: "UE8M0 packed int32 (four per 512 values)"}

# Arguments a rank's own ValueError may name ("topk_idx: ..."); the REJECTED word carries 1 + the index.
REJECT_ARGS: Tuple[str, ...] = ("x", "x[0]", "x[1]", "topk_idx", "topk_weights", "num_experts", "handle",
                                "expert_alignment", "num_worst_tokens", "previous_event", "async_finish", "use_fp8",
                                "use_ue8m0", "num_max_dispatch_tokens_per_rank", "return_recv_hook")
REJECT_OTHER = len(REJECT_ARGS) + 1  # an error naming none of them (or not a ValueError)

Fingerprint = Tuple[int, ...]  # WORDS ints, in Word order


def make(op: int, call: int, buffer: int, rejected: int = 0, hidden: int = 0, x_dtype: int = 0, scales: int = 0,
         topk: int = 0, weights: bool = False, num_experts: int = 0, handle: int = 0, ll_max_tokens: int = 0,
         use_fp8: bool = False, use_ue8m0: bool = False, num_sms: int = 0) -> Fingerprint:
    """The words in ``Word`` order (the one place that lays them out). The calls below pass every word
    positionally: a fingerprint is made at every call, and keyword arguments cost host time."""
    return (MAGIC, op, call & CALL_MASK, buffer, rejected, hidden, x_dtype, scales, topk, int(weights), num_experts,
            handle & CALL_MASK, ll_max_tokens, int(use_fp8), int(use_ue8m0), num_sms)


# the op codes as plain ints (an enum member costs a lookup per call)
_DISPATCH, _COMBINE = int(Op.DISPATCH), int(Op.COMBINE)
_LL_DISPATCH, _LL_COMBINE = int(Op.LOW_LATENCY_DISPATCH), int(Op.LOW_LATENCY_COMBINE)


def dispatch(call: int, buffer: int, x, topk_idx, topk_weights, num_experts: int, handle,
             num_sms: int = 0) -> Fingerprint:
    """A normal dispatch (validated arguments; ``handle`` given for a cached one, which takes its num_experts;
    ``num_sms``: the Buffer's)."""
    if isinstance(x, (tuple, list)):
        values, scales = x[0], x[1]
        scale_format = SCALES_FP32 if scales.dtype == torch.float32 else SCALES_UE8M0
    else:
        values, scale_format = x, SCALES_NONE
    weights = topk_weights is not None
    if handle is None:  # a route-only dispatch may have no ids
        topk = topk_idx.shape[1] if topk_idx is not None else 0
        return make(_DISPATCH, call, buffer, 0, values.shape[1], DTYPE_CODES[values.dtype], scale_format, topk,
                    weights, num_experts, 0, 0, False, False, num_sms)
    # a cached dispatch sends no ids: only the weights' columns travel
    topk = topk_weights.shape[1] if weights else 0
    return make(_DISPATCH, call, buffer, 0, values.shape[1], DTYPE_CODES[values.dtype], scale_format, topk, weights,
                handle.num_experts, handle.call, 0, False, False, num_sms)


def combine(call: int, buffer: int, x, handle, topk_weights, use_fp8: bool, num_sms: int = 0) -> Fingerprint:
    weights = topk_weights is not None
    return make(_COMBINE, call, buffer, 0, x.shape[1], DTYPE_CODES[x.dtype], SCALES_NONE,
                topk_weights.shape[1] if weights else 0, weights, 0, handle.call, 0, use_fp8, False, num_sms)


def low_latency_dispatch(call: int, buffer: int, x, topk_idx, num_max_dispatch_tokens_per_rank: int,
                         num_experts: int, use_fp8: bool, use_ue8m0: bool) -> Fingerprint:
    return make(_LL_DISPATCH, call, buffer, 0, x.shape[1], DTYPE_CODES[x.dtype], SCALES_NONE, topk_idx.shape[1],
                False, num_experts, 0, num_max_dispatch_tokens_per_rank, use_fp8, use_ue8m0)


def low_latency_combine(call: int, buffer: int, x, topk_idx, handle, use_fp8: bool) -> Fingerprint:
    return make(_LL_COMBINE, call, buffer, 0, x.shape[2], DTYPE_CODES[x.dtype], SCALES_NONE, topk_idx.shape[1],
                True, 0, handle.call, 0, use_fp8)


def rejected(op: str, call: int, buffer: int, error: BaseException) -> Fingerprint:
    """The words of a call whose own validation raised ``error``: the argument it named, nothing else."""
    return make(OP_CODES[op], call, buffer, rejected=reject_code(error))


def reject_code(error: BaseException) -> int:
    """``1 + REJECT_ARGS.index(name)`` for a ValueError ``"name: ..."``, else ``REJECT_OTHER``."""
    name = str(error).split(":", 1)[0] if isinstance(error, ValueError) else None
    return 1 + REJECT_ARGS.index(name) if name in REJECT_ARGS else REJECT_OTHER


# ---- the check ----------------------------------------------------------------------------------------------
def _bool(v: int) -> str:
    return "True" if v else "False"


# Word -> (argument named, what of it, how a value reads), in the order they are reported (the handle first: a
# different handle changes the rest); TOPK's argument depends on the call (below).
_FIELDS = {
    Word.HANDLE: ("handle", "which handle", lambda v: f"the handle of call #{v}" if v else "none (a fresh dispatch)"),
    Word.HIDDEN: ("x", "the hidden size", str),
    Word.X_DTYPE: ("x", "the dtype", lambda v: DTYPE_NAMES.get(v, f"dtype code {v}")),
    Word.SCALES: ("x[1]", "the FP8 scale format", lambda v: SCALE_NAMES.get(v, f"format code {v}")),
    Word.WEIGHTS: ("topk_weights", "whether it is given", lambda v: "given" if v else "None"),
    Word.TOPK: (None, "the top-k", str),
    Word.NUM_EXPERTS: ("num_experts", "the value", str),
    Word.LL_MAX_TOKENS: ("num_max_dispatch_tokens_per_rank", "the value", str),
    Word.USE_FP8: ("use_fp8", "the value", _bool),
    Word.USE_UE8M0: ("use_ue8m0", "the value", _bool),
    Word.NUM_SMS: ("num_sms", "the Buffer's setting", str),
}


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _by_value(values: Sequence[int], show=str, ranks: Optional[Sequence[int]] = None) -> str:
    """"12 on ranks 0, 2 vs 24 on rank 1": each value with the ranks that hold it, in order of first holder
    (``values[i]`` is rank ``ranks[i]``'s, rank ``i``'s without ``ranks``)."""
    groups: Dict[int, List[int]] = {}
    for r, v in zip(ranks if ranks is not None else range(len(values)), values):
        groups.setdefault(v, []).append(r)
    return " vs ".join(f"{show(v)} on {_ranks(rs)}" for v, rs in groups.items())


def check(rows: Sequence[Sequence[int]], ranks: Optional[Sequence[int]] = None) -> None:
    """``rows[r]``: rank r's words (``rows[i]`` rank ``ranks[i]``'s, where only some ranks' words are at hand).
    Returns when every rank made the same call with the same call-wide arguments; otherwise raises ValueError whose
    text depends only on ``rows`` (the same on every rank), naming the first of: a word that is not a fingerprint,
    the call order (op, call number, Buffer), a rank that rejected its call, then every argument that differs, with
    each rank's value."""
    first = list(rows[0])
    if (len(first) == WORDS and first[Word.MAGIC] == MAGIC and not first[Word.REJECTED]
            and all(list(row) == first for row in rows)):
        return  # the common case, kept short (host time)
    rows = [tuple(int(v) for v in row) for row in rows]
    column = lambda w: [row[w] for row in rows]  # noqa: E731
    label = list(ranks) if ranks is not None else list(range(len(rows)))
    bad = [label[i] for i, row in enumerate(rows) if len(row) != WORDS or row[Word.MAGIC] != MAGIC]
    if bad:
        raise ValueError(f"fingerprint: {_ranks(bad)} sent words that are not a deepcomm call fingerprint "
                         f"(layout version {MAGIC & 0xFFFF} expected); every rank must run the same deepcomm")
    ops, calls, buffers = column(Word.OP), column(Word.CALL), column(Word.BUFFER)
    name = lambda op: OP_NAMES.get(op, f"op {op}")  # noqa: E731
    if len(set(buffers)) > 1:
        raise ValueError("call order: ranks are in calls of different Buffers ("
                         + _by_value(buffers, lambda b: f"Buffer #{b}", label)
                         + "); every rank must call the same Buffer")
    if len(set(ops)) > 1 or len(set(calls)) > 1:
        raise ValueError("call order: the ranks are in different calls on this Buffer ("
                         + _by_value([o << 32 | c for o, c in zip(ops, calls)],
                                     lambda k: f"{name(k >> 32)} #{k & 0xFFFFFFFF}", label)
                         + "); every rank must make the same calls in the same order; no rank ran the call")
    where = f"{name(ops[0])} call #{calls[0]} on this Buffer"
    rejects = [(label[i], row[Word.REJECTED]) for i, row in enumerate(rows) if row[Word.REJECTED]]
    if rejects:
        arg = lambda code: REJECT_ARGS[code - 1] if 0 < code <= len(REJECT_ARGS) else "call"  # noqa: E731
        codes = [c for _, c in rejects]
        detail = ("see that rank's error" if len(rejects) == 1 else
                  "see their errors" if len(set(codes)) == 1 else
                  "their errors name " + ", ".join(f"{arg(c)} on rank {r}" for r, c in rejects))
        raise ValueError(f"{arg(codes[0])}: {_ranks([r for r, _ in rejects])} rejected {where} ({detail}); "
                         "no rank ran the call")
    differ = []
    for word, (arg, what, show) in _FIELDS.items():
        values = column(word)
        if len(set(values)) > 1:
            if arg is None:  # TOPK: the ids' columns where ids travel, else the weights'
                weights_only = ops[0] == Op.COMBINE or (ops[0] == Op.DISPATCH and rows[0][Word.HANDLE] != 0)
                arg = "topk_weights" if weights_only else "topk_idx"
            differ.append((arg, what, _by_value(values, show, label)))
    if differ:
        (arg, what, values), more = differ[0], differ[1:]
        raise ValueError(f"{arg}: {what} differs across ranks in {where}: {values}"
                         + "".join(f"; also {a} ({w}): {v}" for a, w, v in more)
                         + f". Every rank must {'set' if arg == 'num_sms' else 'pass'} the same; no rank ran the call")

