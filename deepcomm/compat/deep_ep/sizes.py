"""The deepcomm.Buffer under a deep_ep.Buffer, grown when a call needs more than it holds.

DeepEP sizes its buffers in bytes (``num_nvl_bytes`` / ``num_rdma_bytes``) and streams any token count through
them; deepcomm's Buffer holds ``max_tokens_per_rank`` rows of ``hidden`` per source rank, fixed at construction.
A DeepEP user never names either, so unless the deep_ep.Buffer was given them (then they are fixed, and a call
over them raises ValueError naming the keyword), they start small and grow: a new deepcomm.Buffer is built at the
size a call needs (tokens rounded up to a power of two) and the outgrown one is kept until ``destroy()``, because
the tensors its dispatches returned live in its memory and its handles still combine through it.

Growing builds a Buffer, a collective, so every rank must decide it at the same call with the same sizes:
- hidden and a low-latency call's ``num_max_dispatch_tokens_per_rank`` are the same on every rank in DeepEP's flows
  (its kernels assume it; deepcomm's call fingerprint checks it), and so is ``num_worst_tokens`` (the receive
  size of a graph-captured dispatch, rows = ranks x tokens per rank): growth for them is decided from the call's
  own arguments, with no exchange;
- token counts differ per rank. A fresh dispatch over the maximum on any rank is refused on every rank in that
  same call (deepcomm's contract: a ValueError of a collective call is every rank's, and a fresh dispatch without
  num_worst_tokens reports it before returning). Each rank then joins one all_gather of its (tokens, hidden) and
  all grow to the largest, then run the call again; when nothing needed growing, each rank raises its own error.
  Only refused calls pay for the exchange.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch.distributed as dist

from ...buffer import Buffer as DeepcommBuffer
from ...validation import is_capturing

START_TOKENS, START_HIDDEN = 128, 1024  # before the first call says more (every rank starts the same)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class GrowingBuffer:
    """``current``: the deepcomm.Buffer new calls run on; ``owner(handle)``: the one a handle came from."""

    def __init__(self, make: Callable[..., DeepcommBuffer], max_tokens_per_rank: Optional[int],
                 hidden: Optional[int]) -> None:
        self._make = make  # (max_tokens_per_rank, hidden, num_sms or None) -> a deepcomm.Buffer (collective)
        self.fixed_tokens, self.fixed_hidden = max_tokens_per_rank is not None, hidden is not None
        self.current = make(max_tokens_per_rank or START_TOKENS, hidden or START_HIDDEN, None)
        self.outgrown: List[DeepcommBuffer] = []

    @property
    def max_tokens(self) -> int:
        return self.current.config.max_tokens_per_rank

    @property
    def hidden(self) -> int:
        return self.current.config.hidden

    def owner(self, buffer_id: int) -> DeepcommBuffer:
        for b in [self.current] + self.outgrown:
            if b.buffer_id == buffer_id:
                return b
        return self.current  # deepcomm refuses the handle, naming it

    def _target(self, tokens: int, hidden: int) -> Tuple[int, int]:
        t = self.max_tokens if self.fixed_tokens or tokens <= self.max_tokens else _next_pow2(tokens)
        h = self.hidden if self.fixed_hidden or hidden <= self.hidden else hidden
        return t, h

    def grow_for(self, tokens: int, hidden: int, name: str) -> None:
        """Grow to hold ``tokens`` per rank and ``hidden`` where not fixed; every rank calls it with the same values
        (the deterministic cases above). ``name``: the argument that asked, for the errors."""
        t, h = self._target(tokens, hidden)
        if (t, h) == (self.max_tokens, self.hidden):
            return
        if is_capturing():
            raise ValueError(f"{name}: the Buffer must grow to {t} tokens per rank x hidden {h} for this call, which "
                             "cannot happen during CUDA graph capture: run the call once before capturing")
        if self.current.masked_ranks:
            raise ValueError(f"{name}: the Buffer must grow to {t} tokens per rank x hidden {h} for this call, and "
                             f"building one needs every rank (ranks {self.current.masked_ranks} are masked)")
        new = self._make(t, h, self.current.num_sms)
        self.outgrown.append(self.current)
        self.current = new

    def regrow_after_refusal(self, tokens: int, hidden: int) -> bool:
        """After a fresh dispatch that deepcomm refused on every rank: all ranks exchange what they tried and grow
        to the largest. True when the Buffer grew (run the call again), False when the sizes were not the cause."""
        wanted = [None] * self.current.world_size
        dist.all_gather_object(wanted, (int(tokens), int(hidden)), group=self.current.group)
        t, h = self._target(max(w[0] for w in wanted), max(w[1] for w in wanted))
        if (t, h) == (self.max_tokens, self.hidden):
            return False
        self.grow_for(t, h, "x")
        return True

    def all(self) -> List[DeepcommBuffer]:
        """Every deepcomm.Buffer still held, oldest first (masking applies to each)."""
        return self.outgrown + [self.current]

    def destroy(self) -> None:
        for b in self.all():
            b.destroy()
