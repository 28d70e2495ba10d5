"""Buffer configuration and its analytic defaults."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

DEFAULT_HIDDEN = 7168
DEFAULT_TIMEOUT_S = 100.0


def default_num_sms(sm_count: Optional[int]) -> int:
    """SMs given to the communication kernels when the user does not choose.

    - ``sm_count >= 100`` (H100/H200: 132, B200: 148): 24. Measured EP kernels saturate NVLink with about
      20-24 SMs; more only takes SMs from the expert GEMMs running concurrently on another stream.
    - smaller GPUs: about a fifth of the SMs, rounded down to an even number, at least 2. Even because the
      kernels pair SMs into channels (one sends while its twin receives).
    - ``None`` (no GPU, e.g. the reference backend on CPU): 24, the value for the GPUs we target; the
      reference backend records it but does not use it.
    """
    if sm_count is None or sm_count >= 100:
        return 24
    return max(2, (sm_count // 5) // 2 * 2)


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected >= 1, got {value}")


@dataclass
class Config:
    """Settings of one Buffer. Validated on construction (``ValueError`` naming the field)."""

    num_sms: int = 24
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_tokens_per_rank: int = 4096
    hidden: int = DEFAULT_HIDDEN
    num_max_low_latency_tokens: int = 128
    gpus_per_node: Optional[int] = None  # None: one node (Buffer fills it in from deepcomm.topology)

    def __post_init__(self) -> None:
        _check_positive_int("num_sms", self.num_sms)
        _check_positive_int("max_tokens_per_rank", self.max_tokens_per_rank)
        _check_positive_int("hidden", self.hidden)
        _check_positive_int("num_max_low_latency_tokens", self.num_max_low_latency_tokens)
        if self.gpus_per_node is not None:
            _check_positive_int("gpus_per_node", self.gpus_per_node)
        if self.hidden % 8 != 0:
            raise ValueError(f"hidden: expected a multiple of 8, got {self.hidden}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)):
            raise ValueError(f"timeout_s: expected a number, got {type(self.timeout_s).__name__}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: expected > 0, got {self.timeout_s}")
        self.timeout_s = float(self.timeout_s)
