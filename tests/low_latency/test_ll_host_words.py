"""The host exchange of the call that makes the low-latency buffer (deepcomm/cuda/host_words.py, used by
LowLatencyEngine._agree_on_host), on gloo processes with the group's store: every rank's words in rank order, the
same ValueError on every rank when they differ, and a rank that never comes named in a CommTimeoutError within the
timeout (not the process group's own timeout), the engine then broken."""
import time
import types

from tests.helpers.multiproc import run_ranks


def _engine(rank, world):
    import torch
    import torch.distributed as dist
    from deepcomm.cuda.ll_calls import LowLatencyEngine
    record = types.SimpleNamespace(masked=frozenset(), timeout_ns=int(2e9), broken=False, broken_peer=None)
    return LowLatencyEngine(None, dist.group.WORLD, rank, world, torch.device("cpu"), record, None, "ipc", 1)


def _exchanges(rank, world):
    from deepcomm import agreement
    from deepcomm.errors import CommTimeoutError
    eng = _engine(rank, world)
    out = {}
    words = agreement.make(int(agreement.Op.LOW_LATENCY_DISPATCH), 1, 1, hidden=7168, num_experts=64,
                           ll_max_tokens=128)
    eng._agree_on_host(words)
    out["agree"] = "ok"
    other = agreement.make(int(agreement.Op.LOW_LATENCY_DISPATCH), 2, 1, hidden=7168 if rank else 4096,
                           num_experts=64, ll_max_tokens=128)
    try:
        eng._agree_on_host(other)
        out["differ"] = "returned"
    except ValueError as e:
        out["differ"] = str(e)
    for n in range(3, 7):  # the store keys of earlier exchanges are cleaned up as later ones come
        eng._agree_on_host(agreement.make(int(agreement.Op.LOW_LATENCY_DISPATCH), n, 1, hidden=7168))
    t0 = time.monotonic()
    if rank == 0:  # rank 1 never makes this call
        try:
            eng._agree_on_host(words)
            out["missing"] = "returned"
        except CommTimeoutError as e:
            out["missing"] = (e.peer, e.stage)
        out["seconds"] = time.monotonic() - t0
        out["broken"] = (eng.record.broken, eng.record.broken_peer)
    import torch.distributed as dist
    dist.barrier()
    return out


def test_the_buffer_making_exchange_agrees_names_differences_and_times_out_naming_the_peer():
    r0, r1 = run_ranks(_exchanges, 2, timeout=120)
    assert r0["agree"] == r1["agree"] == "ok"
    assert r0["differ"] == r1["differ"] != "returned"
    assert r0["differ"].startswith("x: the hidden size differs across ranks"), r0["differ"]
    assert r0["missing"] == (1, "low_latency:buffer")
    assert r0["seconds"] < 10  # the Buffer's timeout (2 s), not the process group's
    assert r0["broken"] == (True, 1)
