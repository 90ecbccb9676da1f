import pytest
import torch

from compress.errors import CompressError
from compress.quant import WeightScheme, check_group_size, dequantize, fake_quantize, matches, quantize


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_codes_in_range_and_error_bounded(symmetric, bits):
    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    scheme = WeightScheme(bits, 32, symmetric)
    codes, scale, zero = quantize(weight, scheme)
    assert codes.dtype == torch.int8 and scale.shape == (32, 4)
    assert codes.min() >= scheme.qmin and codes.max() <= scheme.qmax
    assert (zero is None) == symmetric
    error = (dequantize(codes, scale, zero, 32) - weight).abs()
    # round-to-nearest is off by at most half a step, plus at most half a step of clipping at the top code
    assert (error <= scale.repeat_interleave(32, dim=1) * 1.0 + 1e-6).all()
    assert torch.equal(dequantize(codes, scale, zero, 32), fake_quantize(weight, scheme))


def test_more_bits_less_error():
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    errors = [(fake_quantize(weight, WeightScheme(b, 64)) - weight).pow(2).mean() for b in (2, 3, 4, 8)]
    assert errors == sorted(errors, reverse=True)


def test_asymmetric_zero_point_is_exact_for_zero():
    weight = torch.rand(4, 64) + 0.5  # all positive: the range still includes 0
    codes, scale, zero = quantize(weight, WeightScheme(4, 64, symmetric=False))
    assert torch.all(dequantize(torch.zeros_like(codes) + zero.repeat_interleave(64, 1), scale, zero, 64) == 0)


def test_group_size_error_names_sizes_that_fit():
    message = r"model.layers.0.mlp.up_proj: input width 576 .* sizes that fit: \[16, 32, 64\]"
    with pytest.raises(CompressError, match=message):
        check_group_size("model.layers.0.mlp.up_proj", 576, WeightScheme(4, 128))
    check_group_size("x", 576, WeightScheme(4, None))  # per-channel always fits


def test_ignore_patterns():
    assert matches("lm_head", ["lm_head"])
    assert matches("model.layers.3.mlp.down_proj", ["mlp.down_proj"])
    assert matches("model.layers.3.mlp.down_proj", [r"re:layers\.3\."])
    assert not matches("model.layers.13.mlp.down_proj", [r"re:layers\.3\."])
    assert not matches("model.layers.3.mlp.up_proj", ["proj"])
