"""Every ptx/ helper run on the GPU, compared with plain C++ twins and Python."""
import random

import pytest
import torch

from tests.helpers.nccl_run import gpu_count

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")]


def test_ptx_helpers_match_plain_code():
    from deepcomm._ext import load_selftest, selftest_error
    S = load_selftest()
    if S is None:
        pytest.skip(f"the test-only module deepcomm._selftest is not available ({selftest_error()})")
    rng = random.Random(11)
    values = [rng.getrandbits(64) | 1 for _ in range(32)]
    torch.cuda.set_device(0)
    r = S.ptx_selftest(values)
    assert r["bswap64"] == [S.bswap64_host(v) for v in values]
    assert r["bswap32"] == [S.bswap32_host(v & 0xFFFFFFFF) for v in values]
    assert (r["acquire_sys"], r["acquire_gpu"], r["relaxed_sys"], r["na_u64"]) == tuple(values[:4])
    assert r["acquire_sys_u32"] == values[4] & 0xFFFFFFFF
    assert r["volatile_s32"] == int.from_bytes((values[4] & 0xFFFFFFFF).to_bytes(4, "little"), "little", signed=True)
    n = r["threads"]
    assert r["add_sys"] == r["add_gpu"] == r["add_gpu_u32"] == n * (n + 1) // 2
    assert (r["cas_old_first"], r["cas_old_second"], r["cas_final"]) == (0, 5, 5)
    assert r["lanemask_lt"] == [(1 << lane) - 1 for lane in range(32)]
    assert r["named_barrier_seen"] == 7
    assert r["copy_mismatches"] == 0
    assert r["timer_advanced"] == 1
