import pytest
import torch

from compress.base.errors import CompressError
from compress.grids.int_grid import WeightScheme, check_group_size, fake_quantize, matches, quantize
from compress.kernels.dequant import dequantize_codes


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_codes_in_range_and_error_bounded(symmetric, bits):
    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    scheme = WeightScheme(bits, 32, symmetric)
    codes, scale, zero = quantize(weight, scheme)
    assert codes.dtype == torch.int8 and scale.shape == (32, 4)
    assert codes.min() >= scheme.qmin and codes.max() <= scheme.qmax
    assert (zero is None) == symmetric
    error = (dequantize_codes(codes, scale, zero, 32) - weight).abs()
    # round-to-nearest is off by at most half a step (plus float rounding of w / scale): the range maps onto
    # 2**bits - 1 steps, so the one code that clips (the top one of a symmetric group, +7.5 -> +7) is half a step away
    step = scale.repeat_interleave(32, dim=1)
    assert (error <= step * 0.5 + weight.abs() * 2**-20).all()
    assert (error > step * 0.49).any()  # and the bound is tight
    assert torch.equal(dequantize_codes(codes, scale, zero, 32), fake_quantize(weight, scheme))


def test_more_bits_less_error():
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    errors = [(fake_quantize(weight, WeightScheme(b, 64)) - weight).pow(2).mean() for b in (2, 3, 4, 8)]
    assert errors == sorted(errors, reverse=True)


def test_asymmetric_zero_point_is_exact_for_zero():
    weight = torch.rand(4, 64) + 0.5  # all positive: the range still includes 0
    codes, scale, zero = quantize(weight, WeightScheme(4, 64, symmetric=False))
    assert torch.all(dequantize_codes(torch.zeros_like(codes) + zero.repeat_interleave(64, 1), scale, zero, 64) == 0)


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


@pytest.mark.parametrize("error_rows", [1024, 10], ids=["whole", "rows-in-chunks"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_one_dequantization_reference_for_codes_packed_layers_and_gptq(symmetric, error_rows, monkeypatch):
    """compress.kernels.dequant.dequantize_codes is the only codes → float arithmetic: the packed layer, fake
    quantization, a g_idx naming the plain groups, and GPTQ's own error report (whole or a few rows at a time) agree
    with it."""
    from compress.formats import QuantizedLinear
    from compress.stages import gptq
    from compress.stages.gptq import gptq_quantize

    monkeypatch.setattr(gptq, "ERROR_ROWS", error_rows)

    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(48, 128, generator=generator)
    scheme = WeightScheme(4, 32, symmetric)
    codes, scale, zero = quantize(weight, scheme)
    reference = dequantize_codes(codes, scale, zero, 32)
    assert torch.equal(QuantizedLinear.from_codes(codes, scale, zero, 4, 32).dequantized_weight(), reference)
    assert torch.equal(fake_quantize(weight, scheme), reference)
    assert torch.equal(dequantize_codes(codes, scale, zero, 32, torch.arange(128) // 32), reference)

    x = torch.randn(256, 128, generator=generator)
    hessian = x.T @ x / len(x)
    result = gptq_quantize(weight, hessian, scheme, block_size=32)
    delta = dequantize_codes(result.codes, result.scale, result.zero_point, 32) - weight
    expected = ((delta @ hessian) * delta).sum() / ((weight @ hessian) * weight).sum()
    assert result.hessian_error == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_finds_one_nan_or_inf_anywhere(dtype):
    from compress.grids.int_grid import all_finite

    weight = torch.randn(48, 80).to(dtype)
    assert all_finite(weight) and all_finite(weight[:0])
    for bad in (float("nan"), float("inf"), float("-inf")):
        broken = weight.clone()
        broken[17, 63] = bad
        assert not all_finite(broken), bad
