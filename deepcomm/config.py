"""Buffer configuration and its analytic defaults."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

DEFAULT_HIDDEN = 7168
DEFAULT_TIMEOUT_S = 100.0
LL_MEMORY_KINDS = ("ipc", "nvshmem")
LL_MEMORY_ENV = "DEEPCOMM_LL_MEMORY"
INTERNODE_TRANSPORTS = ("emulated", "nvshmem", "nvshmem-host")
NVSHMEM_TRANSPORTS = ("nvshmem", "nvshmem-host")  # both reach other hosts through NVSHMEM
INTERNODE_TRANSPORT_ENV = "DEEPCOMM_INTERNODE_TRANSPORT"
ARENA_FULL_WAYS = ("place", "copy")  # what a fresh dispatch does when the output arena has no worst-case block
ARENA_FULL_ENV = "DEEPCOMM_ARENA_FULL"


def _resolve_choice(arg: str, value: Optional[str], env_name: str, choices, default: str) -> str:
    """``value`` when given (exactly one of ``choices``), else ``$env_name`` (trimmed, any case), else ``default``;
    ``ValueError`` names the argument or the variable."""
    if value is None:
        env = os.environ.get(env_name, "").strip()
        if not env:
            return default
        if env.lower() not in choices:
            raise ValueError(f"{env_name}: expected one of {', '.join(choices)}, got {env!r}")
        return env.lower()
    if value not in choices:
        raise ValueError(f"{arg}: expected one of {', '.join(map(repr, choices))} or None, got {value!r}")
    return value


def env_positive_int(name: str) -> Optional[int]:
    """``$name`` as a positive int, or None where it is unset or blank; ``ValueError`` names the variable."""
    env = os.environ.get(name, "").strip()
    if not env:
        return None
    try:
        n = int(env)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{name}: expected a positive integer, got {env!r}")
    return n


def resolve_low_latency_memory(value: Optional[str]) -> str:
    """Where the CUDA backend puts its low-latency buffer: ``value`` when given, else ``$DEEPCOMM_LL_MEMORY``, else
    "ipc" (cudaMalloc + CUDA IPC). "nvshmem" uses NVSHMEM's symmetric heap. ``ValueError`` names the source."""
    return _resolve_choice("low_latency_memory", value, LL_MEMORY_ENV, LL_MEMORY_KINDS, "ipc")


def resolve_internode_transport(value: Optional[str]) -> str:
    """What carries the internode exchange rounds of the CUDA backend (topologies of several nodes): ``value``
    when given, else ``$DEEPCOMM_INTERNODE_TRANSPORT``, else "emulated" (GPU-posted mlx5 WQEs executed by the
    device emulated NIC; every rank on one host). "nvshmem": the internode kernels issue NVSHMEM device puts and
    signals on its symmetric heap (needs the optional module deepcomm._nvshmem_kernels). "nvshmem-host": the
    same rounds through NVSHMEM's host API, stream-ordered, with the torch routing (the fallback where the
    device module is not built). ``ValueError`` names the source."""
    return _resolve_choice("internode_transport", value, INTERNODE_TRANSPORT_ENV, INTERNODE_TRANSPORTS, "emulated")


def resolve_arena_full() -> str:
    """What the CUDA backend's fresh dispatch does when its output arena has no worst-case block free (more outputs
    alive than it holds): ``$DEEPCOMM_ARENA_FULL``, else "place": wait for the counts first, then place the rows in
    a block of their exact size where one is free (no copy; the payload waits for the host), else in the bounce
    area. "copy": the payload goes behind notify at once, into the bounce area, and is copied out (one device copy;
    no wait before the payload). ``ValueError`` names the variable."""
    return _resolve_choice("arena_full", None, ARENA_FULL_ENV, ARENA_FULL_WAYS, "place")


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
    low_latency_memory: Optional[str] = None  # "ipc" | "nvshmem"; None: $DEEPCOMM_LL_MEMORY, else "ipc"
    # "emulated" | "nvshmem"; None: $DEEPCOMM_INTERNODE_TRANSPORT, else "emulated". Used only by several nodes.
    internode_transport: Optional[str] = None
    # Whether internode_transport was chosen (argument or environment) rather than defaulted: with ranks on several
    # hosts, backend="auto" replaces the default with "nvshmem" (deepcomm/backends.py).
    internode_transport_chosen: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.low_latency_memory = resolve_low_latency_memory(self.low_latency_memory)
        self.internode_transport_chosen = (self.internode_transport is not None
                                           or bool(os.environ.get(INTERNODE_TRANSPORT_ENV, "").strip()))
        self.internode_transport = resolve_internode_transport(self.internode_transport)
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
