"""Host twins of the ptx/ helpers (in the test-only module deepcomm._selftest); runs wherever the extension is built, CI included."""
import random

import pytest

from deepcomm._ext import load_selftest, selftest_error

S = load_selftest()
pytestmark = pytest.mark.skipif(S is None, reason=f"deepcomm._selftest is not available ({selftest_error()})")


def _swap(v: int, nbytes: int) -> int:
    return int.from_bytes(v.to_bytes(nbytes, "little"), "big")


def test_bswap_twins_against_python():
    rng = random.Random(7)
    values = [0, 1, 0xFF, 0x0102030405060708, 2**64 - 1] + [rng.getrandbits(64) for _ in range(200)]
    for v in values:
        assert S.bswap64_host(v) == _swap(v, 8)
        assert S.bswap32_host(v & 0xFFFFFFFF) == _swap(v & 0xFFFFFFFF, 4)
    assert S.bswap32_host(0x11223344) == 0x44332211  # hand-computed
