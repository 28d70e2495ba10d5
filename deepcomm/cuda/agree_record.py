"""What the CUDA kernels leave when the ranks' call fingerprints differ (csrc/runtime/agree_record.hpp), turned into
the ValueError every rank raises. The kernels hand over every rank's 16 words as they saw them (the same on every
rank), so the text comes from deepcomm/agreement.py's ``check``, word for word what the reference backend says.

Two places hold such words: a fresh dispatch's counts in mapped host memory (read by the host in that call,
``dispatch_disagreement``), and the AgreeRecord that the other calls (cached dispatch, combine, low-latency mode, a
fresh dispatch with ``num_worst_tokens``) leave beside the error record, raised at the next call or synchronize()
(``recorded_disagreement``, called by deepcomm/cuda/error_record.py)."""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

from .. import agreement

NO_FINGERPRINT = (0,) * agreement.WORDS  # a call that takes no part in agreement (the kernels skip it)


def words_or_none(fingerprint: Optional[Sequence[int]]) -> tuple:
    """The words a binding takes: ``fingerprint`` as a tuple, or NO_FINGERPRINT."""
    return NO_FINGERPRINT if fingerprint is None else tuple(fingerprint)


def disagreement_error(rows: Sequence[Sequence[int]], peer: int, word: int, rank: Optional[int] = None,
                       left_out: Iterable[int] = ()) -> ValueError:
    """The ValueError for every rank's words ``rows`` (``rows[s]``: rank s's). Ranks in ``left_out`` (masked in
    low-latency mode: their words were not read) count as agreeing with ``rank``. ``peer`` / ``word``: the first
    difference the kernel found, named only if the rows, as read, happen to agree."""
    rows = [list(r) for r in rows]
    if rank is not None:
        for s in left_out:
            if 0 <= s < len(rows):
                rows[s] = list(rows[rank])
    try:
        agreement.check(rows)
    except ValueError as e:
        return e
    name = agreement.Word(word).name if 0 <= word < agreement.WORDS else f"word {word}"
    return ValueError(f"fingerprint: rank {peer} disagreed about this call ({name}); every rank must pass the same; "
                      "no rank ran the call")


def dispatch_disagreement(C, counts_host: int, world_size: int) -> ValueError:
    """A fresh dispatch whose counts came back with a difference (its wait returned status 3)."""
    disagree, word, rows = C.read_dispatch_disagreement(counts_host, world_size)
    return disagreement_error(rows, disagree - 1, word)


def recorded_disagreement(C, agree_host: int, rank: int, masked: Iterable[int] = ()) -> ValueError:
    """The AgreeRecord's difference (the error record named stage ``disagree``); clears the AgreeRecord."""
    flag, peer, word, _, rows = C.read_agree(agree_host)
    C.clear_agree(agree_host)
    if flag != 1 or not rows:
        return ValueError("fingerprint: the ranks disagreed about a call (the record of it was not complete); every "
                          "rank must make the same calls with the same arguments; no rank ran the call")
    return disagreement_error(rows, peer, word, rank, masked)
