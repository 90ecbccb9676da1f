"""FP8 block-wise (128x128 weight blocks, per-token groups of 128 activations): weight quantization byte-equal to
compressed-tensors' FP8_BLOCK, the Triton activation quantizer bit-equal to its reference, the block-scaled GEMM
(native FP8 dot and fp16-decoded) against the torch reference. Interpreter, or compiled via tests/cuda_shim.py."""

import os

import pytest
import torch

from compress.kernels.accuracy import relative_error
from compress.kernels.fp8_block import (
    dequantize_fp8_blocks,
    fp8_block_linear,
    fp8_block_linear_reference,
    fp8_block_matmul,
    quantize_per_token_group,
    quantize_per_token_group_reference,
    quantize_weight_fp8_blocks,
)

pytestmark = pytest.mark.gpu  # also run against the compiled kernels: COMPRESS_TEST_DEVICE=cuda pytest -m gpu

FP8 = torch.float8_e4m3fn
ON_GPU = os.environ.get("COMPRESS_TEST_DEVICE") == "cuda"


def random(shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_blocks_match_compressed_tensors_byte_for_byte(dtype):
    """200 rows: the second block row is ragged (compressed-tensors pads it with zeros); one block is all zero.
    Its scale has the weight's dtype (it divides in bf16 for a bf16 weight): asked for that dtype, so do we.
    compressed-tensors is a dependency; the GPU image lacks it, and that box runs this module for the rest."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.naive_quantized import FloatQuantizationCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    weight = random((200, 256), seed=0).to(dtype)
    weight[128:, 128:] = 0.0
    scheme = preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    blocks = torch.nn.functional.pad(weight, (0, 0, 0, 56)).reshape(2, 128, 2, 128)
    scale, _ = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), scheme.weights)
    theirs = FloatQuantizationCompressor.compress({"weight": weight.clone(), "weight_scale": scale}, scheme)
    codes, ours_scale = quantize_weight_fp8_blocks(weight, scale_dtype=dtype)
    assert codes.dtype == FP8 and codes.shape == (200, 256)
    assert ours_scale.dtype == theirs["weight_scale"].dtype == dtype and ours_scale.shape == (2, 2)
    assert torch.equal(codes.view(torch.uint8), theirs["weight"].view(torch.uint8))
    assert torch.equal(ours_scale, theirs["weight_scale"])
    assert ours_scale[1, 1].item() == torch.finfo(dtype).eps


def test_fp32_block_scales_of_a_bf16_weight_round_once():
    weight = random((128, 128), seed=6).to(torch.bfloat16)
    codes, scale = quantize_weight_fp8_blocks(weight)
    assert scale.dtype == torch.float32
    expected = (weight.float() / (weight.float().abs().max() / 448)).to(FP8)
    assert torch.equal(codes.view(torch.uint8), expected.view(torch.uint8))


def test_weight_block_error_is_half_an_e4m3_step():
    weight = random((130, 300), seed=1, scale=0.02)
    codes, scale = quantize_weight_fp8_blocks(weight)
    assert scale.shape == (2, 3)
    expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:130, :300]
    error = (dequantize_fp8_blocks(codes, scale) - weight).abs()
    # 3 mantissa bits: half a step is 2**-4 of the value; below 2**-6 (subnormal) the half step is 2**-10 units
    assert (error <= weight.abs() * 2**-4 + expanded * 2**-10).all()
    assert codes.float().abs().amax().item() == 448.0


def activations(m, k, dtype=torch.float16, seed=0):
    x = random((m, k), seed=seed, scale=3.0)
    x[1] = 0.0  # an all-zero token must quantize to zeros, not NaN
    x[2, :128] *= 1000  # one group far louder than the rest of its token
    return x.to(dtype)


def test_token_group_quantization_equals_reference_bit_for_bit():
    x = activations(5, 320)  # two full groups and a short one of 64
    codes, scale = quantize_per_token_group(x)
    expected_codes, expected_scale = quantize_per_token_group_reference(x)
    assert codes.dtype == FP8 and scale.shape == (5, 3)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(codes.view(torch.uint8), expected_codes.view(torch.uint8))
    assert not codes[1].float().any()
    assert codes[2, :128].float().abs().max().item() == 448.0 and codes[2, 128:256].float().abs().max() == 448.0


@pytest.mark.parametrize("m", [3, 17])
@pytest.mark.parametrize("decode_fp8", [False, True], ids=["native", "decoded"])
def test_block_scaled_gemm_matches_reference(decode_fp8, m):
    """Pre-quantized operands (the interpreter's own fp8 casts are wrong): N=136 is ragged for both the 64-wide
    tile and the 128-row weight block, K=192 for the 128-wide groups."""
    weight_codes, weight_scale = quantize_weight_fp8_blocks(random((136, 192), seed=2, scale=0.05))
    x_codes, x_scale = quantize_per_token_group_reference(activations(m, 192, torch.float32, seed=m))
    bias = random((136,), seed=3)
    out = fp8_block_matmul(x_codes, x_scale, weight_codes, weight_scale, bias, torch.float32, decode_fp8=decode_fp8)
    x_dequant = x_codes.float() * x_scale.repeat_interleave(128, dim=1)[:, :192]
    expected = x_dequant @ dequantize_fp8_blocks(weight_codes, weight_scale).T + bias
    assert out.shape == (m, 136)
    # Hopper's fp8 tensor cores add products with fewer mantissa bits than fp32 (near-exact in the interpreter)
    assert relative_error(out, expected) < (2e-4 if ON_GPU and not decode_fp8 else 1e-5)


def test_fp8_block_linear_matches_reference_end_to_end():
    weight_codes, weight_scale = quantize_weight_fp8_blocks(random((96, 256), seed=4, scale=0.05))
    x = activations(6, 256).reshape(2, 3, 256)
    out = fp8_block_linear(x, weight_codes, weight_scale)
    expected = fp8_block_linear_reference(x, weight_codes, weight_scale)
    assert out.dtype == torch.float16 and out.shape == (2, 3, 96)
    assert relative_error(out, expected) < 2e-3  # both end in fp16


def test_bad_operands_raise():
    codes, scale = quantize_weight_fp8_blocks(random((128, 256), seed=5))
    x_codes, x_scale = quantize_per_token_group_reference(activations(4, 256))
    with pytest.raises(ValueError, match="scales must be"):
        fp8_block_matmul(x_codes, x_scale, codes, scale.T.contiguous()[:1], None, torch.float32)
    with pytest.raises(ValueError, match="must equal the weight block width"):
        fp8_block_matmul(x_codes, x_scale, codes, scale, None, torch.float32, group=64)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_block_matmul(x_codes.float(), x_scale, codes, scale, None, torch.float32)
