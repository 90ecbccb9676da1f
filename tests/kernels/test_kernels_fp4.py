"""FP4 weight-dequant GEMM (interpreter, or compiled via tests/cuda_shim.py): NVFP4 and MXFP4 weights packed two
codes per byte, fp16 activations, ragged M/N/K tails against the plain-torch reference."""

import pytest
import torch

from compress.grids.fp4_grid import quantize_mxfp4, quantize_nvfp4
from compress.kernels.accuracy import relative_error
from compress.kernels.fp4 import dequantize_fp4_reference, fp4_linear, fp4_linear_reference, pack_fp4

pytestmark = pytest.mark.gpu  # also run against the compiled kernels: COMPRESS_TEST_DEVICE=cuda pytest -m gpu


def random(shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("m", [3, 17])
@pytest.mark.parametrize(
    ("quantize", "k"), [(quantize_nvfp4, 80), (quantize_mxfp4, 96)], ids=["nvfp4-k80", "mxfp4-k96"]
)
def test_fp4_gemm_matches_reference_with_ragged_tiles(quantize, k, m):
    """N=72 and K=80 are not multiples of the 32-wide interpreter tiles; M=3, 17 not of 16."""
    quantized = quantize(random((72, k), seed=k))
    x = random((m, k), seed=m).half()
    bias = random((72,), seed=5).half()
    out = fp4_linear(x, quantized.packed, quantized.scale, quantized.global_scale, bias)
    expected = fp4_linear_reference(x, quantized.packed, quantized.scale, quantized.global_scale, bias)
    assert out.dtype == torch.float16 and out.shape == (m, 72)
    assert relative_error(out, expected) < 2e-3  # the dequantized weight tile is rounded to fp16 before the dot


def test_fp4_gemm_keeps_leading_dims():
    quantized = quantize_mxfp4(random((32, 64), seed=1))
    x = random((2, 3, 64), seed=2).half()
    out = fp4_linear(x, quantized.packed, quantized.scale)
    expected = fp4_linear_reference(x.reshape(6, 64), quantized.packed, quantized.scale).reshape(2, 3, 32)
    assert out.shape == (2, 3, 32)
    assert relative_error(out, expected) < 2e-3


def identity_times(packed, scale, global_scale):
    """``I @ W.T``: the kernel's dequantized weight, read back through the GEMM (exact when it fits fp16)."""
    k = packed.shape[1] * 2
    return fp4_linear(torch.eye(k, dtype=torch.float16), packed, scale, global_scale).T


def test_kernel_decodes_every_code_and_e8m0_exponent_exactly():
    codes = torch.arange(16, dtype=torch.uint8).repeat(24, 2)  # 24 rows x 32 columns: each code in every row
    exponents = torch.arange(24, dtype=torch.uint8)[:, None] + 115  # scales 2**-12 .. 2**11
    packed = pack_fp4(codes)
    assert torch.equal(identity_times(packed, exponents, None), dequantize_fp4_reference(packed, exponents).half())


def test_kernel_decodes_every_fp8_group_scale_exactly():
    fp8_bits = torch.arange(1, 127, dtype=torch.uint8)  # every positive finite e4m3 (subnormals included)
    scales = fp8_bits.view(torch.float8_e4m3fn).reshape(63, 2)
    codes = torch.arange(16, dtype=torch.uint8).repeat(63, 2)  # 63 rows x 32 columns: two NVFP4 groups per row
    packed, global_scale = pack_fp4(codes), torch.tensor([1.0])
    out = identity_times(packed, scales, global_scale)
    assert torch.equal(out, dequantize_fp4_reference(packed, scales, global_scale).half())


def test_bad_operands_raise():
    quantized = quantize_nvfp4(random((16, 32), seed=0))
    with pytest.raises(ValueError, match="fp16 or bf16"):
        fp4_linear(random((2, 32), seed=1), quantized.packed, quantized.scale, quantized.global_scale)
    with pytest.raises(ValueError, match="with one \\(NVFP4\\)"):
        fp4_linear(random((2, 32), seed=1).half(), quantized.packed, quantized.scale, None)
    with pytest.raises(ValueError, match="K=32"):
        fp4_linear(random((2, 64), seed=1).half(), quantized.packed, quantized.scale, quantized.global_scale)
