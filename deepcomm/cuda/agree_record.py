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


def is_low_latency(words: Sequence[int]) -> bool:
    """Whether ``words`` are those of a low-latency call (else a normal-mode one)."""
    return words[agreement.Word.OP] in (agreement.Op.LOW_LATENCY_DISPATCH, agreement.Op.LOW_LATENCY_COMBINE)


def other_mode_words(rows: Sequence[Sequence[int]], rank: Optional[int]) -> Optional[tuple]:
    """When some peer was in a call of the other mode than this rank's (normal mode against low-latency mode): the
    first such peer's words. Such a call stopped without advancing this rank's call numbers of that mode, which
    the peer's did; this rank owes the Buffer that call (deepcomm/cuda/mode_meet.py pays it)."""
    if rank is None or not 0 <= rank < len(rows):
        return None
    own = rows[rank]
    if len(own) != agreement.WORDS or own[agreement.Word.MAGIC] != agreement.MAGIC:
        return None
    for r, row in enumerate(rows):
        if (r != rank and len(row) == agreement.WORDS and row[agreement.Word.MAGIC] == agreement.MAGIC
                and row[agreement.Word.CALL] == own[agreement.Word.CALL]
                and is_low_latency(row) != is_low_latency(own)):
            return tuple(int(v) for v in row)
    return None


def _note_owed(rows, rank, owed: Optional[list]) -> None:
    if owed is not None:
        words = other_mode_words(rows, rank)
        if words is not None:
            owed.append(words)


def dispatch_disagreement(C, counts_host: int, world_size: int, rank: Optional[int] = None,
                          owed: Optional[list] = None) -> ValueError:
    """A fresh dispatch whose counts came back with a difference (its wait returned status 3). A peer met in a
    low-latency call adds its words to ``owed`` (other_mode_words)."""
    disagree, word, rows = C.read_dispatch_disagreement(counts_host, world_size)
    _note_owed(rows, rank, owed)
    return disagreement_error(rows, disagree - 1, word)


def recorded_disagreement(C, agree_host: int, rank: int, masked: Iterable[int] = (),
                          owed: Optional[list] = None) -> ValueError:
    """The AgreeRecord's difference (the error record named stage ``disagree``); clears the AgreeRecord. A peer met
    in a call of the other mode adds its words to ``owed`` (other_mode_words)."""
    flag, peer, word, _, rows = C.read_agree(agree_host)
    C.clear_agree(agree_host)
    if flag != 1 or not rows:
        return ValueError("fingerprint: the ranks disagreed about a call (the record of it was not complete); every "
                          "rank must make the same calls with the same arguments; no rank ran the call")
    _note_owed(rows, rank, owed)
    return disagreement_error(rows, peer, word, rank, masked)
