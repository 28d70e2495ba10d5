"""deepcomm._C.OwnedViews (csrc/bindings/owned_views.cpp) on the CPU: tensors with storages of their own over one
owner's memory, made through torch's DLPack exchange table, against views torch makes of the same bytes; the owner
kept alive exactly as long as a view; bad specs refused before any view exists; int32_host against torch.tensor."""
import gc
import weakref

import pytest
import torch

from deepcomm._ext import load_extension
from deepcomm.cuda.owned_views import DLPACK_TYPES, absent_spec, owned_views

C = load_extension()
pytestmark = pytest.mark.skipif(C is None or owned_views() is None,
                                reason="needs deepcomm._C and a torch with the DLPack exchange table")


def _spec(byte_offset, shape, dtype):
    return (byte_offset, tuple(shape), *DLPACK_TYPES[dtype])


def _make(owner, specs):
    return owned_views().views(owner, owner.data_ptr(), owner.numel() * owner.element_size(), C.DLPACK_CPU, 0, specs)


def test_views_equal_torchs_views_of_the_same_bytes_with_storages_of_their_own():
    gen = torch.Generator().manual_seed(3)
    for trial in range(20):
        owner = torch.randint(-2**31, 2**31 - 1, (257,), generator=gen, dtype=torch.int64).to(torch.int32)
        raw = owner.view(torch.uint8)
        cases = []
        for dtype in (torch.int32, torch.int64, torch.float32, torch.bool):
            size = dtype.itemsize
            count = int(torch.randint(0, 40, (1,), generator=gen))
            start = int(torch.randint(0, (raw.numel() - count * size) // size + 1, (1,), generator=gen)) * size
            rows = 1 + int(torch.randint(0, 3, (1,), generator=gen))
            shape = (rows, count // rows) if trial % 2 else (count,)
            if dtype is torch.bool:  # a bool tensor's bytes must be 0 or 1
                raw[start:start + count] = raw[start:start + count] & 1
            cases.append((start, shape, dtype))
        made = _make(owner, [_spec(*c) for c in cases])
        storages = set()
        for (start, shape, dtype), t in zip(cases, made):
            n = 1
            for extent in shape:
                n *= extent
            want = raw[start:start + n * dtype.itemsize].view(dtype).view(shape)
            assert t.dtype == dtype and t.shape == want.shape and t.device.type == "cpu"
            assert t._base is None and t.is_contiguous()
            assert torch.equal(t.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))  # NaN bits too
            if n:
                assert t.data_ptr() == want.data_ptr()
                storages.add(t.untyped_storage()._cdata)
        assert len(storages) == sum(1 for _, shape, _ in cases if all(shape))  # none shared


def test_a_view_writes_through_to_the_owner():
    owner = torch.zeros(16, dtype=torch.int32)
    (v,) = _make(owner, [_spec(8, (2, 3), torch.int32)])
    v.copy_(torch.arange(6, dtype=torch.int32).view(2, 3))
    assert owner.tolist() == [0, 0, 0, 1, 2, 3, 4, 5] + [0] * 8


def test_the_owner_lives_as_long_as_a_view():
    owner = torch.arange(32, dtype=torch.int32)
    alive = weakref.ref(owner)
    a, b = _make(owner, [_spec(0, (4,), torch.int32), _spec(64, (8,), torch.int32)])
    del owner
    gc.collect()
    assert alive() is not None and b.tolist() == list(range(16, 24))
    del a
    gc.collect()
    assert alive() is not None
    del b
    gc.collect()
    assert alive() is None


def test_empty_views_need_no_owner():
    made = owned_views().views(None, 0, 0, C.DLPACK_CPU, 0, [absent_spec()] * 3)
    assert [(t.shape, t.dtype) for t in made] == [(torch.Size([0]), torch.float32)] * 3


@pytest.mark.parametrize("spec, error", [
    (_spec(60, (2,), torch.int32), IndexError),        # past the owner's 64 bytes
    (_spec(-4, (1,), torch.int32), IndexError),
    ((0, (-1,), 0, 32), ValueError),                   # negative extent
    ((0, (2,), 0, 12), ValueError),                    # not whole bytes
    ((0, (1, 1, 1, 1, 1), 0, 32), TypeError),          # five dims
    ((0, [2], 0, 32), TypeError),                      # shape not a tuple
    (("0", (2,), 0, 32), TypeError),
    ((0, (2,), 0), TypeError),
])
def test_bad_specs_are_refused_before_any_view(spec, error):
    owner = torch.zeros(16, dtype=torch.int32)
    alive = weakref.ref(owner)
    with pytest.raises(error):
        _make(owner, [_spec(0, (2,), torch.int32), spec])
    del owner
    gc.collect()
    assert alive() is None  # no view was made, so none holds the owner


def test_a_view_with_elements_needs_an_owner():
    with pytest.raises(ValueError, match="owner"):
        owned_views().views(None, 4096, 64, C.DLPACK_CPU, 0, [_spec(0, (2,), torch.int32)])


def test_int32_host_equals_torch_tensor():
    gen = torch.Generator().manual_seed(7)
    for n in (0, 1, 8, 256, 1000):
        values = torch.randint(-2**31, 2**31 - 1, (n,), generator=gen, dtype=torch.int64).tolist()
        for seq in (values, tuple(values)):
            got = owned_views().int32_host(seq)
            assert got.dtype == torch.int32 and got.device.type == "cpu"
            assert torch.equal(got, torch.tensor(values, dtype=torch.int32))
    assert owned_views().int32_host([True, 2]).tolist() == [1, 2]


@pytest.mark.parametrize("values", [[1, 2**31], [-2**31 - 1], [1, 2.0], [None], "12"])
def test_int32_host_refuses_what_is_not_int32(values):
    with pytest.raises(TypeError):
        owned_views().int32_host(values)
