"""What both internode transports (NicTransport, NvshmemTransport) share: the host-mapped error record their
bounded wait kernels fill, the refusal after a timeout, and the release of their registered memory."""
from __future__ import annotations

import torch

from ..errors import CommTimeoutError
from .nvl_buffer import STAGES


class ExchangeRecord:
    """Mixin. The transport sets ``C`` (the extension), ``device``, ``err_host`` (0 until allocated), ``broken``,
    ``region`` and ``mem`` (its registered memory, with ``close()``)."""

    def check_error(self) -> None:
        """Raise CommTimeoutError (rank, peer, stage, round) when a wait of this transport timed out; the transport
        then refuses further rounds."""
        flag, rank, peer, stage, seq, waited_ns = self.C.read_error(self.err_host)
        if flag:
            self.broken = True
            raise CommTimeoutError(rank, None if peer < 0 else peer, STAGES.get(stage, f"stage {stage}"),
                                   f"exchange round #{seq}, waited {waited_ns / 1e9:.3f} s")

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        if self.err_host:
            self.C.host_mapped_free(self.err_host)
            self.err_host = 0
        self.region = None
        self.mem.close()
