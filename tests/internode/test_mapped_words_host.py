"""The host side of the tagged words a fresh internode dispatch's counts reach the host through
(csrc/kernels/host_words.hpp, deepcomm/internode/mapped_words.py), on host memory: the wait returns the words once
the tag is written (by another Python thread, which runs because the wait releases the GIL), ends at once when an
error record is flagged, and ends after its timeout otherwise; a timeout without a device record is a
CommTimeoutError naming the rank and the stage, and marks the transport broken. The kernel that writes the words
and the tag runs in tests/internode/test_internode.py."""
from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from deepcomm._ext import load_extension
from deepcomm.errors import CommTimeoutError

C = load_extension()
pytestmark = pytest.mark.skipif(C is None, reason="deepcomm._C is not built (no nvcc at install time)")


def _block(n):
    return torch.zeros(C.transport.host_words_bytes(n), dtype=torch.uint8)


def test_the_wait_returns_the_words_once_the_tag_lands():
    T = C.transport
    block = _block(5)
    words = torch.tensor([7, -3, 0, 2 ** 31 - 1, 42], dtype=torch.int32)

    def land():  # what the kernel does: the words, then the tag
        time.sleep(0.2)
        block[16:16 + 20] = words.view(torch.uint8)
        block[:8] = torch.tensor([9], dtype=torch.int64).view(torch.uint8)

    writer = threading.Thread(target=land)
    writer.start()
    t0 = time.monotonic()
    status, got = T.wait_host_words(block.data_ptr(), 9, 5, 10.0, [])
    writer.join()
    assert status == 0 and got == words.tolist() and time.monotonic() - t0 < 5.0
    # an older tag is not this call's
    status, got = T.wait_host_words(block.data_ptr(), 10, 5, 0.2, [])
    assert (status, got) == (2, [])


def test_a_flagged_error_record_ends_the_wait_at_once():
    T = C.transport
    block = _block(1)
    record = torch.zeros(C.error_record_bytes(), dtype=torch.uint8)
    quiet = torch.zeros(C.error_record_bytes(), dtype=torch.uint8)
    record[:4] = torch.tensor([1], dtype=torch.int32).view(torch.uint8)  # flag = 1: a device wait timed out
    t0 = time.monotonic()
    assert T.wait_host_words(block.data_ptr(), 1, 1, 30.0, [quiet.data_ptr(), record.data_ptr()]) == (1, [])
    assert time.monotonic() - t0 < 5.0


def test_fetch_raises_a_timeout_naming_rank_and_stage(monkeypatch):
    from deepcomm.internode.mapped_words import MappedWords

    block = _block(3)
    T = types.SimpleNamespace(host_words_bytes=C.transport.host_words_bytes, wait_host_words=C.transport.wait_host_words,
                              words_to_host=lambda *a: None)  # the copy never lands
    mw = MappedWords(types.SimpleNamespace(host_mapped_alloc=lambda n: (block.data_ptr(), 0),
                                           host_mapped_free=lambda p: None), T, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    checked = []
    tr = types.SimpleNamespace(err_host=0, broken=False, check_error=lambda: checked.append("tr"))
    link = types.SimpleNamespace(err_host=0, broken=False, check_error=lambda: checked.append("link"))
    with pytest.raises(CommTimeoutError) as got:
        mw.fetch(torch.zeros(3, dtype=torch.int32), 0.2, [tr, link], 3, "dispatch:counts (host)")
    assert got.value.rank == 3 and got.value.stage == "dispatch:counts (host)" and got.value.peer is None
    assert tr.broken and checked == ["tr", "link"]  # the device records were read first
