"""W8A8 Triton kernels (interpreter): per-token activation quantization, int8 GEMM (exact), FP8 GEMM."""

import os

import pytest
import torch

from compress.kernels import ops
from compress.kernels.accuracy import relative_error
from compress.kernels.backend import use_backend
from compress.kernels.dtypes import FP8_MAX
from compress.kernels.w8a8 import (
    quantize_per_token,
    quantize_per_token_reference,
    scaled_mm,
    scaled_mm_reference,
)

pytestmark = pytest.mark.gpu  # also run against the compiled kernels: COMPRESS_TEST_DEVICE=cuda pytest -m gpu

FP8 = torch.float8_e4m3fn

ON_GPU = os.environ.get("COMPRESS_TEST_DEVICE") == "cuda"  # tests/cuda_shim.py runs the kernels compiled


def activations(m, k, dtype=torch.float16, seed=0):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[1] = 0.0  # an all-zero token must quantize to zeros, not NaN
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_int8_activation_quantization_equals_reference(dtype):
    x = activations(37, 200, dtype)  # K=200 spans several interpreter blocks of 64, with a masked tail
    codes, scale = quantize_per_token(x, torch.int8)
    expected_codes, expected_scale = quantize_per_token_reference(x, torch.int8)
    assert codes.dtype == torch.int8 and scale.shape == (37, 1)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(codes, expected_codes)
    assert codes.abs().max() == 127 and not codes[1].any()


def test_int8_activation_rounding_is_half_to_even():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.0]])  # absmax 127 -> scale exactly 1
    codes, _ = quantize_per_token(x, torch.int8)
    assert codes.tolist() == [[127, 0, 2, 2, 0, -2, -2, 3]]


def test_fp8_dynamic_activation_quantization_matches_reference():
    x = activations(9, 130)
    codes, scale = quantize_per_token(x, FP8)
    expected_codes, expected_scale = quantize_per_token_reference(x, FP8)
    assert codes.dtype == FP8
    assert torch.equal(scale, expected_scale)
    assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))
    assert codes.float().abs().amax(dim=1)[0] == FP8_MAX


def test_fp8_rounding_matches_torch_on_every_binade_and_tie():
    grid = torch.arange(256, dtype=torch.uint8)
    grid = grid[(grid & 0x7F) < 0x7F].view(FP8).float()  # every finite e4m3 value
    midpoints = (grid.sort().values[1:] + grid.sort().values[:-1]) / 2  # exact ties, incl. across binades
    x = torch.cat([grid, midpoints, midpoints * 1.0001, torch.tensor([448.0])]).reshape(1, -1)
    codes, scale = quantize_per_token(x, FP8)
    expected_codes, expected_scale = quantize_per_token_reference(x, FP8)
    assert scale.item() == 1.0 == expected_scale.item()
    assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))


def test_fp8_static_activation_quantization_saturates():
    x = activations(5, 96)
    static = torch.tensor([0.01])  # x / 0.01 exceeds 448: codes must clamp, never overflow to NaN
    codes, scale = quantize_per_token(x, FP8, static)
    expected_codes, _ = quantize_per_token_reference(x, FP8, static)
    assert torch.equal(scale, torch.full((5, 1), 0.01))
    assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))
    assert not codes.float().isnan().any() and codes.float().abs().max() == FP8_MAX


def int8_operands(m, n, k, seed=0):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), generator=generator, dtype=torch.int8)
    b = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    return a, b


def test_int8_gemm_is_exact_against_int32():
    a, b = int8_operands(33, 36, 160)  # |sum| < 127*127*160 < 2**24: fp32 output holds the int32 exactly
    ones_m, ones_n = torch.ones(33, 1), torch.ones(36, 1)
    out = scaled_mm(a, ones_m, b, ones_n, None, torch.float32)
    assert torch.equal(out, (a.to(torch.int32) @ b.to(torch.int32).T).float())


@pytest.mark.parametrize("k", [1024, 4097, 20001])
def test_int8_reference_sums_exactly_past_the_fp32_limit(k):
    """The CPU reference sums in fp32 stretches: it must still equal the exact sum rounded once to fp32, where
    one fp32 GEMM does not (here a plain fp32 GEMM is off by 4 at K=4097 and by 3360 at K=20001)."""
    a, b = torch.full((2, k), 127, dtype=torch.int8), torch.full((3, k), 127, dtype=torch.int8)
    b[1, ::3], a[1, ::7] = -128, 1
    ones_m, ones_n = torch.ones(2, 1), torch.ones(3, 1)
    exact = (a.to(torch.int64) @ b.to(torch.int64).T).to(torch.float64).float()
    assert torch.equal(scaled_mm_reference(a, ones_m, b, ones_n, None, torch.float32), exact)


def test_int8_gemm_epilogue_equals_reference():
    a, b = int8_operands(20, 44, 96)
    a_scale, b_scale = torch.rand(20, 1) / 100, torch.rand(44, 1) / 100
    bias = torch.randn(44)
    out = scaled_mm(a, a_scale, b, b_scale, bias, torch.float32)
    rtol = 1e-5 if ON_GPU else 1e-6  # the GPU fuses the epilogue's multiply-adds (FMA): last-bit differences
    assert torch.allclose(out, scaled_mm_reference(a, a_scale, b, b_scale, bias, torch.float32), rtol=rtol)
    half = scaled_mm(a, a_scale, b, b_scale, bias.half(), torch.float16)
    assert half.dtype == torch.float16
    assert relative_error(half, scaled_mm_reference(a, a_scale, b, b_scale, bias, torch.float32)) < 1e-3


@pytest.mark.parametrize("decode_fp8", [False, True], ids=["native", "decoded"])
def test_fp8_gemm_matches_reference(decode_fp8):
    generator = torch.Generator().manual_seed(0)
    a = (torch.randn(19, 96, generator=generator) * 50).to(FP8)
    b = (torch.randn(36, 96, generator=generator) * 50).to(FP8)
    a_scale, b_scale, bias = torch.rand(19, 1), torch.rand(36, 1), torch.randn(36)
    out = scaled_mm(a, a_scale, b, b_scale, bias, torch.float32, decode_fp8=decode_fp8)
    expected = scaled_mm_reference(a, a_scale, b, b_scale, bias, torch.float32)
    # Hopper's fp8 tensor cores add products with fewer mantissa bits than fp32 (exact in the interpreter)
    assert relative_error(out, expected) < (2e-4 if ON_GPU and not decode_fp8 else 1e-6)


def test_fp8_decode_is_exact_for_every_e4m3_value():
    patterns = torch.tensor([p for p in range(256) if p not in (0x7F, 0xFF)], dtype=torch.uint8)  # not NaN
    weight = torch.cat([patterns, torch.zeros(256 - len(patterns), dtype=torch.uint8)]).view(FP8)
    weight = weight.reshape(8, 32)  # N=8 rows of K=32 codes
    identity = torch.eye(32).to(FP8)  # row m picks column m of every weight row
    ones_m, ones_n = torch.ones(32, 1), torch.ones(8, 1)
    out = scaled_mm(identity, ones_m, weight, ones_n, None, torch.float32, decode_fp8=True)
    assert torch.equal(out, weight.float().T)


def test_operand_checks():
    a, b = int8_operands(4, 8, 64)
    with pytest.raises(ValueError, match="both be int8"):
        scaled_mm(a, torch.ones(4, 1), b.to(torch.float32), torch.ones(8, 1), None, torch.float32)
    with pytest.raises(ValueError, match="K=64"):
        scaled_mm(a, torch.ones(4, 1), b[:, :32], torch.ones(8, 1), None, torch.float32)
    with pytest.raises(ValueError, match="static input scale"):
        quantize_per_token(torch.randn(2, 64), torch.int8, torch.tensor([1.0]))


@pytest.mark.parametrize("kind", ["int8", "fp8", "fp8-static"])
def test_linear_ops_kernel_path_matches_reference_path(kind):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 96, generator=generator, dtype=torch.float32).half()
    dense = torch.randn(40, 96, generator=generator) / 10
    scale = dense.abs().amax(dim=1, keepdim=True) / (127 if kind == "int8" else FP8_MAX)
    bias = torch.randn(40).half()
    if kind == "int8":
        weight = torch.round(dense / scale).to(torch.int8)
        run = lambda: ops.int8_linear(x, weight, scale, bias)  # noqa: E731
    else:
        weight = (dense / scale).to(FP8)
        static = torch.tensor([0.05]) if kind == "fp8-static" else None
        run = lambda: ops.fp8_linear(x, weight, scale, bias, static)  # noqa: E731
    with use_backend("triton"):
        kernel = run()
    with use_backend("reference"):
        reference = run()
    assert kernel.shape == (2, 5, 40) and kernel.dtype == torch.float16
    assert relative_error(kernel, reference) < 1e-3
    truth = x.double() @ dense.double().T + bias.double()
    assert relative_error(reference, truth) < 0.1
