"""Package surface: import without the extension, config defaults, errors, timeouts."""
import pickle
import subprocess
import sys
import time

import pytest
import torch

import deepcomm
from deepcomm.config import Config, default_num_sms
from tests.helpers.multiproc import run_ranks
from tests.helpers.paths import ROOT


def test_import_without_extension():
    # sys.modules[name] = None makes "import deepcomm._C" raise ImportError, as on a machine without the build
    code = ("import sys; sys.modules['deepcomm._C'] = None\n"
            "import deepcomm\n"
            "from deepcomm import _ext\n"
            "assert _ext.load_extension() is None and 'deepcomm._C' in _ext.extension_error()\n"
            "assert deepcomm.available_backends() == ['reference']\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_public_names():
    for name in ("Buffer", "Handle", "LowLatencyHandle", "CommTimeoutError", "fp8", "ops", "available_backends"):
        assert hasattr(deepcomm, name), name
    assert "reference" in deepcomm.available_backends()


def test_default_num_sms():
    assert default_num_sms(132) == 24 and default_num_sms(148) == 24 and default_num_sms(None) == 24
    assert default_num_sms(80) == 16 and default_num_sms(46) == 8 and default_num_sms(4) == 2
    for sms in range(1, 200):
        n = default_num_sms(sms)
        assert n >= 2 and n % 2 == 0


def test_config_defaults_and_checks():
    cfg = Config()
    assert (cfg.timeout_s, cfg.max_tokens_per_rank, cfg.hidden, cfg.num_max_low_latency_tokens) == \
        (100.0, 4096, 7168, 128)
    with pytest.raises(ValueError, match="^num_max_low_latency_tokens:"):
        Config(num_max_low_latency_tokens=0)
    with pytest.raises(ValueError, match="^timeout_s:"):
        Config(timeout_s="soon")


def test_comm_timeout_error_fields_and_pickle():
    err = deepcomm.CommTimeoutError(3, 1, "dispatch:payload")
    assert isinstance(err, RuntimeError)
    assert "rank 3" in str(err) and "peer 1" in str(err) and "dispatch:payload" in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert (again.rank, again.peer, again.stage) == (3, 1, "dispatch:payload") and str(again) == str(err)


def test_buffer_needs_initialized_process_group():
    with pytest.raises(RuntimeError, match="not initialized"):
        deepcomm.Buffer()


def test_handles_are_dataclasses_with_documented_fields():
    from dataclasses import fields
    assert [f.name for f in fields(deepcomm.Handle)] == [
        "buffer_id", "num_experts", "num_tokens", "hidden", "num_recv", "is_token_in_rank", "send_pos",
        "count_matrix", "recv_src_idx", "num_recv_tokens_per_expert", "node_count_matrix", "node_route", "call",
        "per_expert_tensor"]
    assert [f.name for f in fields(deepcomm.LowLatencyHandle)] == [
        "src_info", "layout", "recv_pos", "num_experts", "num_max_dispatch_tokens_per_rank", "hidden", "buffer_id",
        "slot", "call"]


def _timeout_worker(rank, world):
    import deepcomm
    buf = deepcomm.Buffer(max_tokens_per_rank=8, hidden=64, timeout_s=1.0)
    assert buf.size_bytes() == 0 and buf.num_sms == 24
    buf.set_num_sms(8)
    assert buf.num_sms == 8 and "reference" in repr(buf)
    if rank == 1:        # never joins the dispatch
        time.sleep(3)
        return None
    start = time.monotonic()
    try:
        buf.dispatch(torch.zeros(2, 64), topk_idx=torch.zeros(2, 1, dtype=torch.int64), num_experts=2)
    except deepcomm.CommTimeoutError as err:
        return (err.rank, err.peer, err.stage, time.monotonic() - start)
    return "no timeout"


def test_missing_peer_raises_comm_timeout():
    got = run_ranks(_timeout_worker, 2, timeout=60)[0]
    assert got[:3] == (0, None, "dispatch:counts"), got
    assert got[3] < 10


def test_destroyed_buffer_refuses_work():
    buf = object.__new__(deepcomm.Buffer)
    buf._backend = None
    with pytest.raises(RuntimeError, match="destroy"):
        buf.synchronize()
    buf.destroy()  # idempotent on a dead buffer
