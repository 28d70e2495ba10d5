"""FP8 helpers: exact rounding, error bounds, UE8M0 scales, packing."""
import pytest
import torch

from deepcomm import fp8


def _inputs(seed=0, tokens=6, hidden=512):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen) * torch.logspace(-3, 3, tokens).unsqueeze(1)
    x[0, :128] = 0.0            # all-zero block: amax floor
    x[1, 5] = 1e30              # huge outlier: must saturate, not overflow
    return x


def _e4m3_grid():
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return every[torch.isfinite(every)].unique()


def test_values_are_round_to_nearest_even_of_fp32_quotient():
    x = _inputs()
    values, scales = fp8.per_token_cast_to_fp8(x)
    q = (x.reshape(6, 4, 128) / scales.unsqueeze(-1)).reshape(6, 512).clamp(-448, 448)
    grid = _e4m3_grid()
    dist = (q.reshape(-1, 1).double() - grid.double()).abs()
    best = dist.min(dim=1).values
    got = values.float().reshape(-1)
    # the chosen grid value is at minimal distance; on ties its mantissa is even
    got_dist = (q.reshape(-1).double() - got.double()).abs()
    assert torch.equal(got_dist, best)
    ties = ((dist == best.unsqueeze(1)).sum(dim=1) > 1).nonzero()[:, 0]
    mantissa = got[ties].to(torch.float8_e4m3fn).view(torch.uint8) & 1
    assert bool((mantissa == 0).all())


def test_scale_is_fp32_amax_over_448_with_floor():
    x = _inputs()
    _, scales = fp8.per_token_cast_to_fp8(x)
    amax = x.reshape(6, 4, 128).abs().amax(-1).clamp(min=1e-4)
    assert torch.equal(scales, amax / 448.0)
    assert scales[0, 0] == torch.tensor(1e-4, dtype=torch.float32) / 448.0


def test_quantization_error_bound_and_saturation():
    x = _inputs(seed=1)
    values, scales = fp8.per_token_cast_to_fp8(x)
    assert not torch.isnan(values.float()).any()
    back = fp8.per_token_cast_back(values, scales)
    per_elem_scale = scales.repeat_interleave(128, dim=1)
    err = (back - x).abs()
    # 3 mantissa bits: half an ulp is 2^-4 relative; below the normal range 2^-10 * scale absolute
    bound = torch.maximum(x.abs() * 2.0 ** -4, per_elem_scale * 2.0 ** -10) * (1 + 1e-6)
    assert bool((err <= bound).all())
    assert values.float().abs().max() == 448.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ue8m0_scales_are_powers_of_two_at_least_exact(seed):
    x = _inputs(seed)
    _, exact = fp8.per_token_cast_to_fp8(x)
    values, scales = fp8.per_token_cast_to_fp8(x, use_ue8m0=True)
    mantissa = scales.view(torch.int32) & 0x7FFFFF
    assert bool((mantissa == 0).all())
    assert bool((scales >= exact).all()) and bool((scales < 2 * exact).all())
    # already a power of two: unchanged
    pow2 = torch.tensor([[0.25, 1.0, 2.0 ** -20, 8.0]])
    assert torch.equal(fp8.ue8m0_round_up(pow2), pow2)
    err = (fp8.per_token_cast_back(values, scales) - x).abs()
    assert bool((err <= torch.maximum(x.abs() * 2.0 ** -4, scales.repeat_interleave(128, 1) * 2.0 ** -10)).all())


def test_pack_unpack_round_trip_and_byte_order():
    x = _inputs(hidden=1024)
    _, scales = fp8.per_token_cast_to_fp8(x, use_ue8m0=True)
    packed = fp8.pack_ue8m0(scales)
    assert packed.dtype == torch.int32 and packed.shape == (6, 2)
    assert torch.equal(fp8.unpack_ue8m0(packed), scales)
    exps = ((scales.view(torch.int32) >> 23) & 0xFF).tolist()
    word = packed[2, 1].item() & 0xFFFFFFFF
    assert [(word >> (8 * i)) & 0xFF for i in range(4)] == exps[2][4:8]   # block 4 in the lowest byte
    values, _ = fp8.per_token_cast_to_fp8(x, use_ue8m0=True)
    assert torch.equal(fp8.per_token_cast_back(values, packed), fp8.per_token_cast_back(values, scales))


def test_leading_dims_and_errors():
    x = torch.randn(2, 3, 256)
    values, scales = fp8.per_token_cast_to_fp8(x)
    assert values.shape == (2, 3, 256) and scales.shape == (2, 3, 2)
    with pytest.raises(ValueError, match="^x:"):
        fp8.per_token_cast_to_fp8(torch.randn(2, 100))
    with pytest.raises(ValueError, match="^scales:"):
        fp8.pack_ue8m0(torch.ones(2, 6))
    with pytest.raises(ValueError, match="^values:"):
        fp8.per_token_cast_back(torch.randn(2, 128), torch.ones(2, 1))
