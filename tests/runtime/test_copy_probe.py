"""The copy probes dev/profile_copy.py times (deepcomm._selftest.copy_probe): on the CPU, the arguments they refuse
before any launch; on a GPU, every kind moves every byte of rows of a few sizes, whatever the block count."""
import pytest
import torch

from deepcomm._ext import load_selftest, selftest_error
from tests.helpers.nccl_run import gpu_count

S = load_selftest()
pytestmark = pytest.mark.skipif(S is None, reason=f"deepcomm._selftest is not available ({selftest_error()})")

KINDS = [
    dict(kind="vectors", unroll=4, threads=1024),
    dict(kind="vectors", unroll=16, l2_hint=True),
    dict(kind="bulk", producers=4, slots=4),
    dict(kind="bulk", producers=3, slots=3, chunk=1024),
    dict(kind="ring", producers=5, slots=3, chunk=2048),
    dict(kind="ring", producers=2, slots=1, lane0_waits=True),
    dict(kind="memcpy"),
]


def _probe(spec, src, dst, rows, row_bytes, blocks, stream=0):
    kw = dict(spec)
    S.copy_probe(kw.pop("kind"), src, dst, rows, row_bytes, blocks, stream, **kw)


@pytest.mark.parametrize("bad, match", [
    (dict(row_bytes=24), "multiples of 16"),
    (dict(src=8), "multiples of 16"),
    (dict(kind="bulk", slots=1), "slots >= 2"),
    (dict(kind="bulk", producers=16, slots=8), "producers \\* slots"),
    (dict(kind="vectors", unroll=3), "unroll"),
    (dict(kind="vectors", threads=48), "threads"),
    (dict(kind="tma"), "kind must be"),
])
def test_probe_refuses_bad_arguments_before_launching(bad, match):
    args = dict(kind="vectors", src=1 << 20, dst=2 << 20, rows=4, row_bytes=64, blocks=1)
    args.update(bad)
    kind = args.pop("kind")
    with pytest.raises(ValueError, match=match):
        S.copy_probe(kind, args.pop("src"), args.pop("dst"), args.pop("rows"), args.pop("row_bytes"),
                     args.pop("blocks"), 0, **args)


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1, reason="needs a GPU")
@pytest.mark.parametrize("spec", KINDS, ids=lambda s: "-".join(str(v) for v in s.values()))
@pytest.mark.parametrize("rows, row_bytes, blocks", [(1, 16, 1), (37, 7168 * 2 + 48, 5), (300, 2048, 24)])
def test_probe_copies_every_byte(spec, rows, row_bytes, blocks):
    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda").manual_seed(rows * 7 + row_bytes)
    src = torch.randint(0, 256, (rows * row_bytes,), dtype=torch.uint8, device="cuda", generator=g)
    dst = torch.zeros(rows * row_bytes + 64, dtype=torch.uint8, device="cuda")
    _probe(spec, src.data_ptr(), dst.data_ptr(), rows, row_bytes, blocks,
           torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(dst[:rows * row_bytes], src)
    assert int(dst[rows * row_bytes:].count_nonzero()) == 0  # nothing past the rows
