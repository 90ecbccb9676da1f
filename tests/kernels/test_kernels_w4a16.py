"""W4A16 Triton kernels (interpreter, fp16/fp32 operands) against the float64 truth and the torch reference."""

import os

import pytest
import torch

from compress.kernels import ops
from compress.kernels.accuracy import float64_linear, relative_error
from compress.kernels.backend import use_backend
from compress.kernels.configs import W4A16_DEQUANT_MIN_M
from compress.kernels.dequant import dequantize_codes, dequantize_packed
from compress.kernels.packing import pack_int32
from compress.kernels.w4a16 import (
    dequantize_weight_kn,
    repack_n_contiguous,
    weight_only_linear_reference,
    weight_only_matmul,
)

pytestmark = pytest.mark.gpu  # also run against the compiled kernels: COMPRESS_TEST_DEVICE=cuda pytest -m gpu

ON_GPU = os.environ.get("COMPRESS_TEST_DEVICE") == "cuda"  # tests/cuda_shim.py runs the kernels compiled
FP16_TOLERANCE = 2e-3  # fp16 rounding of the dequantized weight and of the output
FP32_TOLERANCE = 1e-5


def quantized_weight(n, k, group_size, num_bits=4, asym=False, act_order=False, scale_dtype=torch.float16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    low, high = -(2 ** (num_bits - 1)), 2 ** (num_bits - 1)
    codes = torch.randint(low, high, (n, k), generator=generator, dtype=torch.int8)
    groups = k // group_size
    scale = (torch.rand(n, groups, generator=generator) * 0.05 + 0.01).to(scale_dtype)
    zero = torch.randint(-3, 4, (n, groups), generator=generator, dtype=torch.int8) if asym else None
    g_idx = (torch.randperm(k, generator=generator) // group_size).to(torch.int32) if act_order else None
    return dict(codes=codes, packed=pack_int32(codes, num_bits), scale=scale, zero=zero, g_idx=g_idx)


def check(
    m,
    n,
    k,
    group_size,
    dtype=torch.float16,
    num_bits=4,
    asym=False,
    act_order=False,
    bias=False,
    config=None,
    repacked=False,
):
    w = quantized_weight(n, k, group_size, num_bits, asym, act_order)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    packed_kn = repack_n_contiguous(w["packed"]) if repacked else w["packed"].t()
    out = weight_only_matmul(x, packed_kn, w["scale"], w["zero"], num_bits, group_size, w["g_idx"], b, config)
    dense = dequantize_codes(w["codes"], w["scale"].double(), w["zero"], group_size, w["g_idx"])
    truth = float64_linear(x, dense, b)
    reference = weight_only_linear_reference(
        x, w["packed"], w["scale"], w["zero"], num_bits, k, group_size, w["g_idx"], b
    )
    tolerance = FP16_TOLERANCE if dtype == torch.float16 else FP32_TOLERANCE
    assert out.dtype == dtype and out.shape == (m, n)
    assert relative_error(out, truth) < tolerance
    assert relative_error(reference, truth) < tolerance
    assert relative_error(out, reference) < 2 * tolerance


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("m", [3, 37], ids=["skinny", "gemm"])
def test_every_group_size_sym_and_asym_on_both_paths(group_size, asym, m):
    check(m, 36, 256, group_size, asym=asym)  # N=36 is not a multiple of 8 or of the tile: masked columns


@pytest.mark.parametrize("m", [1, 16, 17, 40])
def test_act_order_g_idx_with_bias(m):
    check(m, 24, 128, 32, asym=True, act_order=True, bias=True)


@pytest.mark.parametrize("m", [5, 33])
def test_k_equal_to_one_group(m):
    check(m, 20, 64, 64, bias=True)


def test_fp32_activations():
    check(7, 40, 128, 64, dtype=torch.float32, asym=True)
    check(20, 40, 128, 64, dtype=torch.float32, act_order=True)


@pytest.mark.parametrize("num_bits", [2, 8])
def test_other_bit_widths_that_fill_whole_words(num_bits):
    check(4, 24, 128, 32, num_bits=num_bits, asym=True)


@pytest.mark.parametrize(
    "config",
    [
        dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=1),  # no atomics, tile spans 2 groups
        dict(BLOCK_N=16, BLOCK_K=16, SPLIT_K=4, num_warps=4, num_stages=1),  # 4 tiles per group, uneven split
    ],
)
def test_skinny_tile_variants(config):
    check(2, 36, 192, 32, asym=True, bias=True, config=config)


GEMV = dict(KIND="gemv", BLOCK_N=16, BLOCK_K=64, SPLIT_K=2, num_warps=4, num_stages=1)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_gemv_tile(m, asym, dtype):
    check(m, 36, 192, 32, dtype=dtype, asym=asym, bias=True, config=GEMV)  # K=192: 3 tiles over 2 splits
    check(m, 36, 192, 64, dtype=dtype, asym=asym, config=dict(GEMV, BLOCK_K=32))  # one group per tile


@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [2, 8])
def test_gemv_other_bit_widths(bits, asym):
    """Each width puts its codes at other positions of the half words (2-bit: 8 a half, 8-bit: 2)."""
    check(1, 24, 256, 64, num_bits=bits, asym=asym, config=dict(GEMV, BLOCK_K=128))


def test_gemv_tile_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="gemv tile takes M <= 4"):
        check(5, 24, 128, 32, config=GEMV)
    with pytest.raises(ValueError, match="gemv tile"):
        check(1, 24, 128, 32, act_order=True, config=GEMV)


def test_gemm_tile_with_one_group_per_tile():
    config = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=3, num_warps=4, num_stages=1)
    check(50, 36, 128, 64, asym=True, bias=True, config=config)


DEQUANT = dict(KIND="dequant", BLOCK_K=64, BLOCK_N=16, num_warps=4, num_stages=1)


@pytest.mark.parametrize("repacked", [False, True], ids=["disk", "repacked"])
@pytest.mark.parametrize("group_size", [32, 128], ids=["tile-spans-groups", "one-group-per-tile"])
def test_dequant_then_matmul_path(repacked, group_size):
    check(5, 36, 256, group_size, asym=True, bias=True, config=DEQUANT, repacked=repacked)
    check(20, 24, 128, 32, act_order=True, config=DEQUANT, repacked=repacked)
    check(3, 40, 128, 64, dtype=torch.float32, asym=True, config=DEQUANT, repacked=repacked)


@pytest.mark.parametrize("bits", [2, 8])
def test_dequant_path_other_bit_widths(bits):
    check(6, 24, 256, 64, num_bits=bits, asym=True, config=DEQUANT)


@pytest.mark.parametrize("repacked", [False, True], ids=["disk", "repacked"])
def test_dequantized_scratch_is_the_reference_weight_bit_for_bit(repacked):
    """Same fp32 arithmetic and one rounding as the reference: the large-M path differs from it only in the GEMM."""
    w = quantized_weight(36, 256, 32, asym=True, act_order=True)
    packed_kn = repack_n_contiguous(w["packed"]) if repacked else w["packed"].t()
    scratch = dequantize_weight_kn(packed_kn, w["scale"], w["zero"], 4, 256, 32, w["g_idx"], torch.float16, DEQUANT)
    expected = dequantize_packed(w["packed"], w["scale"].float(), w["zero"], 4, 256, 32, w["g_idx"])
    assert scratch.shape == (256, 36) and scratch.dtype == torch.float16
    assert torch.equal(scratch, expected.to(torch.float16).T)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's threshold; the GPU tables pick the same way")
def test_rows_from_the_threshold_up_take_the_dequant_path(monkeypatch):
    """fp32 rows and K=512: the tiled kernel's sums differ from torch.matmul's in the last bits, so bit equality
    with dequantize-then-matmul tells which path ran."""
    w = quantized_weight(24, 512, 32)
    packed_kn = repack_n_contiguous(w["packed"])

    def dequant_then_matmul(x):
        scratch = dequantize_weight_kn(packed_kn, w["scale"], None, 4, 512, 32, None, x.dtype, DEQUANT)
        return torch.matmul(x, scratch)

    x = torch.randn(W4A16_DEQUANT_MIN_M["interpreter"], 512, generator=torch.Generator().manual_seed(2))
    assert torch.equal(weight_only_matmul(x, packed_kn, w["scale"], None, 4, 32), dequant_then_matmul(x))
    assert not torch.equal(weight_only_matmul(x[:40], packed_kn, w["scale"], None, 4, 32), dequant_then_matmul(x[:40]))
    monkeypatch.setitem(W4A16_DEQUANT_MIN_M, "interpreter", 40)  # the threshold is data the dispatcher reads
    assert torch.equal(weight_only_matmul(x[:40], packed_kn, w["scale"], None, 4, 32), dequant_then_matmul(x[:40]))


@pytest.mark.parametrize("m", [2, 24])
def test_repacked_layout_matches(m):
    check(m, 36, 128, 32, asym=True, repacked=True)


def test_op_dispatch_keeps_leading_dimensions_and_paths_agree():
    w = quantized_weight(24, 128, 32, asym=True)
    x = torch.randn(2, 3, 128, dtype=torch.float16)
    args = (w["packed"], w["scale"], w["zero"], 4, 128, 32, w["g_idx"], None)
    with use_backend("triton"):
        kernel = ops.weight_only_linear(x, *args)
    with use_backend("reference"):
        reference = ops.weight_only_linear(x, *args)
    assert kernel.shape == (2, 3, 24)
    assert relative_error(kernel, reference) < 2 * FP16_TOLERANCE


@pytest.mark.skipif(ON_GPU, reason="the CUDA shim moves inputs to the GPU")
def test_auto_backend_on_cpu_is_the_reference(monkeypatch):
    monkeypatch.delenv("COMPRESS_KERNELS", raising=False)
    w = quantized_weight(8, 64, 32)
    x = torch.randn(2, 64, dtype=torch.float16)
    args = (x, w["packed"], w["scale"], None, 4, 64, 32)
    assert torch.equal(ops.weight_only_linear(*args), weight_only_linear_reference(*args))


def test_unsupported_bits_fall_back_or_fail_clearly():
    codes = torch.randint(-4, 4, (8, 64), dtype=torch.int8)
    packed, scale = pack_int32(codes, 3), torch.full((8, 2), 0.1)
    x = torch.randn(2, 64)
    with use_backend("auto"):
        assert ops.weight_only_linear(x, packed, scale, None, 3, 64, 32).shape == (2, 8)
    with use_backend("triton"), pytest.raises(ValueError, match="straddle"):
        ops.weight_only_linear(x, packed, scale, None, 3, 64, 32)


@pytest.mark.skipif(ON_GPU, reason="the CUDA shim moves inputs to the GPU")
def test_forcing_triton_without_interpreter_or_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("COMPRESS_KERNELS", "triton")
    w = quantized_weight(8, 64, 32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ops.weight_only_linear(torch.randn(1, 64), w["packed"], w["scale"], None, 4, 64, 32)


def test_bad_backend_name_is_rejected(monkeypatch):
    monkeypatch.setenv("COMPRESS_KERNELS", "cuda")
    w = quantized_weight(8, 64, 32)
    with pytest.raises(ValueError, match="COMPRESS_KERNELS must be one of"):
        ops.weight_only_linear(torch.randn(1, 64), w["packed"], w["scale"], None, 4, 64, 32)


def test_mismatched_scale_shape_is_rejected():
    w = quantized_weight(8, 64, 32)
    with pytest.raises(ValueError, match="scale must be"):
        weight_only_matmul(torch.randn(1, 64), w["packed"].t(), w["scale"][:, :1], None, 4, 32)
