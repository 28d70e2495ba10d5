"""Normal dispatch and combine for topologies of several nodes, hierarchical: between nodes every byte is carried
by GPU-posted mlx5 RDMA-write and fetch-add WQEs (csrc/kernels/internode_exchange.hpp), only between ranks of the
same local index ("rail" peers); inside a node rows move over NVLink peer pointers (node_link.py).

Where there is no NIC (one host posing as several nodes) the WQEs are executed by the device emulated NIC, a block
of the same grid that decodes them and performs the writes over NVLink peer pointers; a ConnectX would execute
the same bytes. The routing (hier_normal.py, over the two-hop communicator of hier_comm.py) sends each token once
per remote node and forwards it inside the node; combine reduces inside the node first and sends one partial per
(token, node). Results equal the reference backend's bit for bit.

That is the "emulated" transport of the RDMA hop (NicTransport, nic_transport.py). ``internode_transport="nvshmem"``
carries the same rounds, between the same rail ranks, as NVSHMEM puts with signals instead (nvshmem_transport.py);
the routing and the NVLink hop are the same either way.

On the kernels (hier_kernels.py) a fresh dispatch waits on the host once, for the counts; a cached dispatch and a
combine not at all: their bounded waits report to the error records, read at the next call and in synchronize().
Rows are still packed before the launch and copied out after it by torch (docs/internode.md). The torch routing
(hier_normal.py, the "nvshmem-host" transport) syncs after every exchange round and NVLink stage.

Low-latency mode takes another road on these topologies (internode_ll.py): the low-latency kernels over every rank,
NVSHMEM puts to the peers NVLink cannot map.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch

from .. import agreement
from ..backend_protocol import Capabilities
from ..config import Config
from ..dispatch_rows import pad_to_worst
from ..errors import CommTimeoutError
from ..hosts import hosts_of
from ..validation import MAX_TOPK
from . import hier_agree, hier_kernels, hier_normal
from .hier_comm import HierComm
from .hier_kernels import HierKernels
from .internode_ll import InternodeLowLatency, low_latency_memory_for
from .internode_rows import max_node_row_bytes
from ..cuda.ll_calls import LowLatencyEngine
from .nic_transport import NicTransport
from .node_link import NodeLink
from .nvshmem_kernels import load_device_kernels
from .nvshmem_transport import NvshmemTransport


class InternodeBackend:
    """The CUDA backend for topologies of several nodes (same interface as the other backends): normal mode
    hierarchical (this file), low-latency mode over the whole group (internode_ll.py)."""

    name = "cuda"
    # BF16 x in normal mode; expert ids checked by Buffer in normal mode (on the kernels by their route kernel
    # instead: __init__) and by the low-latency kernels. Call agreement (fingerprints, hier_agree.py) at any number
    # of GPUs per node: with several, the NVLink hop of the kernels and of the torch routing carries every rank's
    # words too. Normal mode waits on the host for a fresh dispatch's counts and copies small host tables to the
    # device per call, which a CUDA graph cannot replay: only low-latency mode is captured
    capabilities = Capabilities(x_dtypes=(torch.bfloat16,), takes_fingerprints=True,
                                checks_expert_ids_on_device=False,
                                checks_low_latency_ids_on_device=LowLatencyEngine.checks_ids_on_device,
                                counts_joined_calls=True,
                                capturable=frozenset(("low_latency_dispatch", "low_latency_combine")))

    @property
    def event(self):
        """The end of the last normal-mode call on the kernels (they return before it finished), else None: the
        torch routing's calls have finished when they return."""
        return self.kernels.event if self.kernels is not None else None

    def reject(self, fingerprint, handle=None) -> None:
        """This rank's own validation rejected its call: take part in the call's first exchange with
        ``fingerprint`` (its REJECTED word set), so every peer raises naming this rank; nothing moves. Normal mode,
        one GPU per node: one rail exchange carrying nothing but the words (hier_agree.py), the same round a fresh
        dispatch's count exchange or a cached dispatch's or combine's launch makes. Several GPUs per node: a
        dispatch without ``handle`` the count round, on the kernels a cached dispatch (``handle`` given) or a
        combine their launch with no rows (HierKernels.reject). Low-latency mode: the engine's (``handle``: the
        rejected combine's, for its slot). A Buffer a timeout broke sends nothing: its next call says why."""
        if fingerprint[agreement.Word.OP] in (agreement.Op.LOW_LATENCY_DISPATCH, agreement.Op.LOW_LATENCY_COMBINE):
            self.ll.engine.reject(fingerprint, handle=handle)
            return
        if self.transport.broken or self.link.broken:
            return
        try:
            self.ll.record.check_error(low_latency=False, leave_input=True)
            self.transport.check_error()  # an earlier launch's timeout, not read yet (the kernels do not wait)
            self.link.check_error()
        except (RuntimeError, ValueError):
            return
        with torch.cuda.device(self.device):
            combine = fingerprint[agreement.Word.OP] == agreement.Op.COMBINE
            if self.kernels is not None and self.comm.gpus > 1 and (combine or handle is not None):
                self.kernels.reject(fingerprint, cached=handle is not None)
            else:
                hier_agree.join_rejected(self.comm, fingerprint)

    @property
    def broken_reason(self) -> Optional[str]:
        """Why this Buffer takes no more calls, where a call failed inside its crossing (None otherwise)."""
        return self.transport.broken_reason or self.link.broken_reason or self.ll.record.broken_reason

    @property
    def joined_calls(self) -> int:
        """Exchanges entered so far (Capabilities.counts_joined_calls): rail rounds and NVLink stages, each counted
        as it starts (a limit a round checks first, such as a block over the receive slot, raises before), and the
        low-latency engine's first exchanges. A call that raised with this unchanged never began its first
        exchange: the Buffer rejects it for the peers (with the call's handle, which picks that exchange)."""
        return self.transport.round + self.link.epoch + self.ll.engine.joined

    def __init__(self, group, config: Config, rank: int, world_size: int, device: torch.device, C):
        self.config, self.rank, self.world_size, self.device = config, rank, world_size, device
        # low-latency mode spans the whole group, up to the width of its kernels' live-rank mask
        self.capabilities = dataclasses.replace(self.capabilities, max_low_latency_ranks=C.LL_MAX_RANKS)
        G = config.gpus_per_node
        rail = [r for r in range(world_size) if r % G == rank % G]  # RDMA peers: our local index on every node
        use_kernels = os.environ.get("DEEPCOMM_INTERNODE_KERNELS", "1") != "0"
        device_puts = None  # deepcomm._nvshmem_kernels with internode_transport="nvshmem"
        extra = {}
        if config.internode_transport == "nvshmem":  # the kernels issue NVSHMEM device puts (nvshmem_kernels.py)
            transport_cls = NvshmemTransport
            device_puts = load_device_kernels()  # NvshmemUnavailableError naming the reason, before any collective
            extra = dict(signals_per_round=device_puts.NVSHMEM_CHUNKS)
        elif config.internode_transport == "nvshmem-host":  # NVSHMEM's host API, torch routing
            transport_cls = NvshmemTransport
        else:  # "emulated": GPU-posted WQEs, the device emulated NIC
            transport_cls = NicTransport
        with torch.cuda.device(device):
            self.transport = transport_cls(C, group, rank, world_size, device, config.max_tokens_per_rank,
                                           config.hidden, config.timeout_s, peers=rail, **extra)
            if device_puts is not None:
                try:  # NVSHMEM is initialized now (the symmetric block is allocated): register the module
                    device_puts.init_device_state()
                    self.transport.issue_rounds_from(device_puts)  # count rounds too, without a host sync
                except BaseException:
                    self.transport.close()
                    raise
            try:
                self.link = NodeLink(C, group, rank, world_size, G, device,
                                     world_size * config.max_tokens_per_rank * max_node_row_bytes(config.hidden)
                                     + hier_agree.strip_bytes(world_size),
                                     config.timeout_s)
            except BaseException:
                self.transport.close()
                raise
        try:  # low-latency mode: its own buffer over the whole group, made at the first call (internode_ll.py)
            ll_memory = low_latency_memory_for(hosts_of(group), config.low_latency_memory)
            with torch.cuda.device(device):
                self.ll = InternodeLowLatency(C, group, config, rank, world_size, device, ll_memory)
        except BaseException:
            self.link.close()
            self.transport.close()
            raise
        self.comm = HierComm(self.transport, self.link, rank, world_size, G, device)
        # The dedicated kernels (hier_kernels.py) carry the emulated NIC and the NVSHMEM device puts unless
        # DEEPCOMM_INTERNODE_KERNELS=0; "nvshmem-host" (host-side puts) keeps the torch routing (hier_normal.py).
        self.kernels = None
        if use_kernels and (transport_cls is NicTransport or device_puts is not None):
            self.kernels = HierKernels(self.comm, config.num_sms, device_puts=device_puts)
            # a fresh dispatch's ids are range-checked by its route kernel and refused after the count round, on
            # every rank (hier_kernels.fresh_counts): the Buffer's check and its host sync are not needed
            self.capabilities = dataclasses.replace(self.capabilities, checks_expert_ids_on_device=True)

    def get_dispatch_layout(self, topk_idx, num_experts):
        from .. import layout
        return layout.get_dispatch_layout(topk_idx, num_experts, self.world_size)

    def _check_topk(self, k: int) -> None:
        if k > MAX_TOPK:
            raise ValueError(f"topk_idx: at most {MAX_TOPK} experts per token on the internode backend, got {k}")

    def _normal_mode_check(self) -> None:
        """Normal mode needs every rank, and a Buffer a low-latency timeout broke is done (as on one node); an
        input error of a low-latency call stays recorded for that mode."""
        self.ll.record.check_error(low_latency=False, leave_input=True)

    # previous_event / async_finish: accepted so code runs unchanged on every backend. The kernels run on the
    # caller's stream (no host wait but a fresh dispatch's count wait); the torch routing synchronizes.
    def dispatch(self, x, topk_idx, topk_weights, num_experts, handle, expert_alignment, num_worst_tokens=0,
                 previous_event=None, async_finish=False, fingerprint=None):
        self._normal_mode_check()
        for t in (topk_idx, topk_weights):
            if t is not None:
                self._check_topk(t.shape[1])
        if handle is not None and torch.is_tensor(handle.num_recv_tokens_per_expert):
            num_worst_tokens = handle.num_recv
        joined = self.joined_calls
        try:
            with torch.cuda.device(self.device):
                if self.kernels is not None:
                    self.kernels.check_deferred()
                    out = hier_kernels.dispatch(self.kernels, x, topk_idx, topk_weights, num_experts, handle,
                                                expert_alignment, fingerprint)
                else:
                    out = hier_normal.dispatch(self.comm, x, topk_idx, topk_weights, num_experts, handle,
                                               expert_alignment, fingerprint)
        except Exception as e:
            self._break_if_joined("dispatch" if handle is None else "cached dispatch", joined, e)
            raise
        return pad_to_worst(out, num_worst_tokens, handle is not None) if num_worst_tokens else out

    def combine(self, x, handle, topk_weights, previous_event=None, async_finish=False, use_fp8=False,
                fingerprint=None):
        self._normal_mode_check()
        if topk_weights is not None:
            self._check_topk(topk_weights.shape[1])
        joined = self.joined_calls
        try:
            with torch.cuda.device(self.device):
                if self.kernels is not None:
                    self.kernels.check_deferred()
                    return hier_kernels.combine(self.kernels, x, handle, topk_weights, use_fp8, fingerprint)
                return hier_normal.combine(self.comm, x, handle, topk_weights, use_fp8, fingerprint)
        except Exception as e:
            self._break_if_joined("combine", joined, e)
            raise

    def _break_if_joined(self, call: str, joined: int, error: Exception) -> None:
        """After a normal-mode ``call`` raised ``error``: where the call had begun an exchange (joined_calls moved
        past ``joined``) and the error is not one every rank raises alike (a ValueError, decided from what the ranks
        exchanged) nor a timeout (which breaks the Buffer itself), the peers may wait for what this rank never sent:
        the Buffer takes no more calls (RecordedWaits.set_broken_by)."""
        if self.joined_calls != joined and not isinstance(error, (ValueError, CommTimeoutError)):
            self.transport.set_broken_by(call, error)

    # low-latency mode (internode_ll.py)
    def low_latency_dispatch(self, *args, **kwargs):
        return self.ll.engine.dispatch(*args, **kwargs)

    def low_latency_combine(self, *args, **kwargs):
        return self.ll.engine.combine(*args, **kwargs)

    def low_latency_buffer_info(self) -> dict:
        return self.ll.engine.buffer_info()

    @property
    def masked(self) -> frozenset:
        return self.ll.engine.masked

    def mask_ranks(self, ranks: frozenset) -> None:
        self.ll.engine.mask_ranks(ranks)

    def unmask_ranks(self) -> None:
        self.ll.engine.unmask_ranks()

    def nic_totals(self):
        """Per peer, what the emulated NIC executed; {} with the NVSHMEM transport (no NIC of ours)."""
        return self.transport.nic_totals()

    def set_num_sms(self, num_sms: int) -> None:
        """The kernels split num_sms between the RDMA and NVLink roles (their poster and NIC blocks come on top);
        the torch routing (NVSHMEM transport) has no SM setting."""
        if self.kernels is not None:
            self.kernels.set_num_sms(num_sms)

    def size_bytes(self) -> int:
        ll = self.ll.engine.buffer_info()["bytes"]
        return self.transport.size_bytes() + self.link.mem.nbytes + ll

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
        self.transport.check_error()
        self.link.check_error()
        self.ll.synchronize()
        if self.kernels is not None:  # a cached dispatch's or a combine's disagreement (deferred_agree.py)
            self.kernels.synchronize()

    def destroy(self) -> None:
        try:
            self.ll.close()
        finally:
            try:
                self.transport.close()
            finally:
                try:
                    self.link.close()
                finally:
                    if self.kernels is not None:
                        self.kernels.close()  # the mapped block of the fresh dispatches' counts
