"""A few int32 words the host learns from the device without a device-to-host copy or a stream sync: the internode
kernels' fresh dispatch hands its count round's result to the host this way (hier_kernels.fresh_counts). A kernel
queued after the words' producer copies them into pinned, device-mapped host memory and then writes the tag, the
call's number, with release; the host waits on that word with the GIL released, bounded by the timeout and by the
error records of the waits queued before it (csrc/kernels/host_words.hpp)."""
from __future__ import annotations

import ctypes
import time
from typing import List, Sequence

import torch

from ..errors import CommTimeoutError


class MappedWords:
    """One rank's mapped block (grown as needed); ``C`` is deepcomm._C, ``T`` its transport module."""

    def __init__(self, C, T, device: torch.device):
        self.C, self.T, self.device = C, T, device
        self.host = self.dev = 0
        self.capacity = 0  # words the block holds
        self.tag = 0       # the last call's number (0: never written)

    def _reserve(self, n: int) -> None:
        if n <= self.capacity:
            return
        self._free()  # the last wait saw its tag: nothing writes the old block any more
        nbytes = self.T.host_words_bytes(n)
        self.host, self.dev = self.C.host_mapped_alloc(nbytes)
        ctypes.memset(self.host, 0, nbytes)
        self.capacity = n

    def fetch(self, words: torch.Tensor, timeout_s: float, records: Sequence, rank: int, stage: str) -> List[int]:
        """The int32 CUDA tensor ``words`` (filled in stream order) as a list, once its copy has landed: the copy is
        queued on the current stream, then the host waits. A wait of ``records`` (the transport and the link, with
        ``err_host`` and ``check_error()``) that timed out raises its CommTimeoutError; no tag within ``timeout_s``
        raises one for ``stage`` and marks the first record broken (every later call is refused)."""
        words = words.contiguous()
        n = words.numel()
        self._reserve(n)
        self.tag += 1
        stream = torch.cuda.current_stream(words.device).cuda_stream
        self.T.words_to_host(words.data_ptr(), n, self.dev, self.tag, stream)
        errors = [r.err_host for r in records if r.err_host]
        status, got = self.T.wait_host_words(self.host, self.tag, n, timeout_s, errors)
        if status == 0:
            return got
        for _ in range(100 if status == 1 else 1):  # a device wait timed out: its record names peer and stage
            for r in records:
                r.check_error()
            time.sleep(0.01)
        records[0].broken = True
        raise CommTimeoutError(rank, None, stage, f"no counts after {timeout_s:.1f} s")

    def _free(self) -> None:
        if self.host:
            self.C.host_mapped_free(self.host)
        self.host = self.dev = 0
        self.capacity = 0

    def close(self) -> None:
        if self.host:
            torch.cuda.synchronize(self.device)  # a copy after a failed wait may still be queued
        self._free()
