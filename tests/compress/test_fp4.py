"""FP4 quantization (NVFP4, MXFP4): the e2m1 grid, packing, RTN scales, and byte-for-byte agreement with what
compressed-tensors 0.20 writes for the same weight (so our checkpoints load in vLLM and llm-compressor's tools)."""

import pytest
import torch
from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

from compress.base.errors import CompressError
from compress.grids.fp4_grid import (
    e2m1_codes,
    e2m1_round,
    fake_quantize_fp4,
    fake_quantize_fp4_activations,
    mxfp4_scales,
    nvfp4_global_scale,
    nvfp4_scales,
    quantize_fp4_codes,
    quantize_mxfp4,
    quantize_nvfp4,
    quantize_to_grid,
)
from compress.kernels.fp4 import E2M1_GRID, e2m1_to_float, effective_group_scales, pack_fp4, unpack_fp4

ALL_CODES = torch.arange(16, dtype=torch.uint8)
SIGNED_GRID = [*E2M1_GRID, *(-v for v in E2M1_GRID)]  # code order: sign bit 3


def spread_weight(rows=64, cols=128, seed=0):
    """Rows spanning four decades, one all-zero group and a group of tiny negatives (they become -0.0 codes)."""
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    weight = weight * torch.logspace(-3, 1, rows)[:, None]
    weight[0, :32] = 0.0
    weight[1, :5] = -1e-6
    return weight


def test_pack_unpack_round_trips_every_byte_and_code_pair():
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    assert torch.equal(pack_fp4(unpack_fp4(every_byte)), every_byte)
    low, high = torch.meshgrid(ALL_CODES, ALL_CODES, indexing="ij")
    codes = torch.stack((low.flatten(), high.flatten()), dim=1).reshape(1, -1)  # every (even, odd) pair
    packed = pack_fp4(codes)
    assert torch.equal(unpack_fp4(packed), codes)
    assert torch.equal(packed.flatten(), low.flatten() | (high.flatten() << 4))  # even column in the low nibble


def test_packing_rejects_odd_columns_and_non_bytes():
    with pytest.raises(ValueError, match="even number of columns"):
        pack_fp4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        unpack_fp4(torch.zeros(2, 3, dtype=torch.int8))


def test_decoding_the_full_code_table_gives_the_signed_grid():
    values = e2m1_to_float(ALL_CODES)
    assert values.tolist() == SIGNED_GRID
    assert torch.signbit(values[8]) and not torch.signbit(values[0])  # code 8 is -0.0


def test_grid_values_encode_to_their_own_codes():
    assert torch.equal(e2m1_codes(torch.tensor(SIGNED_GRID)), ALL_CODES)


def test_rounding_is_to_nearest_with_ties_to_even_and_saturates():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert e2m1_to_float(e2m1_codes(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert e2m1_to_float(e2m1_codes(torch.tensor([6.5, 1e9, -7.0, 0.26, 2.9]))).tolist() == [6, 6, -6, 0.5, 3]
    assert e2m1_codes(torch.tensor([-0.1, -0.0, 0.0])).tolist() == [8, 8, 0]


def test_rounding_equals_compressed_tensors_cast_to_fp4_on_a_dense_sweep():
    sweep = torch.linspace(-7, 7, 28001)  # steps of 0.0005 hit every tie exactly
    ours = e2m1_to_float(e2m1_codes(sweep))
    theirs = cast_to_fp4(sweep.clamp(-6, 6).clone())
    assert torch.equal(ours, theirs)
    assert torch.equal(torch.signbit(ours), torch.signbit(theirs))


def test_rounded_values_are_the_decoded_codes_at_every_tie_and_its_neighbours():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    around = torch.cat([ties, torch.nextafter(ties, torch.tensor(9.0)), torch.nextafter(ties, torch.tensor(-9.0))])
    values = torch.cat([around, -around, torch.randn(10_000) * 4, torch.tensor([float("inf"), -float("inf"), -0.0])])
    rounded, decoded = e2m1_round(values), e2m1_to_float(e2m1_codes(values))
    assert torch.equal(rounded, decoded)
    assert torch.equal(torch.signbit(rounded), torch.signbit(decoded))


@pytest.mark.parametrize(("preset", "fmt"), [("NVFP4", "nvfp4"), ("MXFP4", "mxfp4")])
def test_activation_rounding_equals_compressed_tensors_dynamic_fake_quant(preset, fmt):
    """W4A4 inputs: per token and group, NVFP4 against a calibrated global scale, as compressed-tensors computes."""
    torch.manual_seed(0)
    x = torch.randn(64, 256) * torch.rand(256) * 5
    args = preset_name_to_scheme(preset, ["Linear"]).input_activations
    global_scale = generate_gparam(x.amin(), x.amax()) if fmt == "nvfp4" else None
    groups = x.reshape(x.shape[0], -1, args.group_size)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=global_scale)
    theirs = fake_quantize(x, scale, zero_point, args, global_scale=global_scale)
    assert torch.equal(fake_quantize_fp4_activations(x, fmt, global_scale), theirs)


def compressed_tensors_checkpoint(weight: torch.Tensor, preset: str) -> dict[str, torch.Tensor]:
    """What compressed-tensors' compressor writes for ``weight`` with RTN (min/max) qparams."""
    scheme = preset_name_to_scheme(preset, ["Linear"])
    groups = weight.reshape(weight.shape[0], -1, scheme.weights.group_size)
    global_scale = generate_gparam(weight.amin(), weight.amax()) if preset == "NVFP4" else None
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=global_scale)
    state = {"weight": weight.clone(), "weight_scale": scale}
    if global_scale is not None:
        state["weight_global_scale"] = global_scale
    compressor = NVFP4PackedCompressor if preset == "NVFP4" else MXFP4PackedCompressor
    compressed = compressor.compress(state, scheme)
    compressed["weight_decompressed"] = compressor.decompress(compressed, scheme)["weight"]
    return compressed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nvfp4_matches_compressed_tensors_byte_for_byte(dtype):
    """In bf16 the global scale and ``amax / 6`` round differently from fp32: still equal to theirs."""
    weight = spread_weight().to(dtype)
    theirs = compressed_tensors_checkpoint(weight, "NVFP4")
    ours = quantize_nvfp4(weight)
    assert set(theirs) == {"weight_packed", "weight_scale", "weight_global_scale", "weight_decompressed"}
    assert ours.packed.dtype == torch.uint8 and ours.packed.shape == (64, 64)
    assert ours.scale.dtype == torch.float8_e4m3fn and ours.scale.shape == (64, 8)
    assert ours.global_scale.dtype == torch.float32 and ours.global_scale.shape == (1,)
    assert torch.equal(ours.packed, theirs["weight_packed"])
    assert torch.equal(ours.scale.view(torch.uint8), theirs["weight_scale"].view(torch.uint8))
    assert torch.equal(ours.global_scale, theirs["weight_global_scale"])
    assert (unpack_fp4(ours.packed) == 8).any()  # the -0.0 codes agree too
    assert ours.scale[0, 0].item() == 0.125  # an all-zero group gets the fp8 eps, as theirs
    assert torch.equal(ours.dequantize().to(torch.bfloat16), theirs["weight_decompressed"])


# Not fp16: there compressed-tensors' 2**(e-127) underflows to 0 for groups with amax below ~2**-22 (the all-zero
# group here), which it then replaces by scale 1 (exponent 127). We keep the real exponent; both decode to zeros.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_matches_compressed_tensors_byte_for_byte(dtype):
    weight = spread_weight(seed=1).to(dtype)
    weight[2, :32] = torch.linspace(-1.75, 1.75, 32).to(dtype)  # group max on the round-up-to-power-of-two edge
    theirs = compressed_tensors_checkpoint(weight, "MXFP4")
    ours = quantize_mxfp4(weight)
    assert set(theirs) == {"weight_packed", "weight_scale", "weight_decompressed"}
    assert ours.global_scale is None
    assert ours.scale.dtype == torch.uint8 and ours.scale.shape == (64, 4)
    assert torch.equal(ours.packed, theirs["weight_packed"])
    assert torch.equal(ours.scale, theirs["weight_scale"])
    assert ours.scale[0, 0].item() == 0 and ours.scale[2, 0].item() == 127 + 1 - 2  # 1.75 rounds up to 2
    assert torch.equal(ours.dequantize().to(torch.bfloat16), theirs["weight_decompressed"])


def test_nvfp4_global_scale_maps_the_largest_group_scale_to_448():
    weight = spread_weight()
    global_scale = nvfp4_global_scale(weight)
    assert global_scale.item() == pytest.approx(448 * 6 / weight.abs().max().item(), rel=1e-6)
    assert nvfp4_scales(weight, global_scale).float().max().item() == 448.0
    assert nvfp4_global_scale(torch.zeros(4, 16)).item() == 1.0  # a zero weight falls back to 1


def test_weights_on_the_grid_survive_exactly():
    codes = torch.randint(0, 16, (8, 64), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    codes[:, ::16] = 7  # every group (of 16 and of 32) holds the top value 6, so amax = 6 * scale
    values = e2m1_to_float(codes)
    mx_exponents = torch.arange(8)[:, None] * 3 - 9  # powers of two from 2**-9 to 2**12
    mx_weight = values * torch.exp2(mx_exponents.float())
    assert torch.equal(quantize_mxfp4(mx_weight).dequantize(), mx_weight)
    fp8_scales = torch.tensor([448.0, 1.0, 0.5, 3.5, 0.01953125, 96.0, 13.0, 0.875])  # e4m3 values, 448 first
    nv_weight = values * fp8_scales[:, None]  # amax = 6 * 448: the global scale is exactly 1
    quantized = quantize_nvfp4(nv_weight)
    assert quantized.global_scale.item() == 1.0
    assert torch.equal(quantized.dequantize(), nv_weight)


@pytest.mark.parametrize("quantize", [quantize_nvfp4, quantize_mxfp4], ids=["nvfp4", "mxfp4"])
def test_quantization_error_is_within_half_a_grid_step(quantize):
    weight = spread_weight(seed=3)
    quantized = quantize(weight)
    group = weight.shape[1] // quantized.scale.shape[1]
    step_unit = effective_group_scales(quantized.scale, quantized.global_scale).repeat_interleave(group, dim=1)
    error = (quantized.dequantize() - weight).abs()
    # off the top: half the widest gap (4 -> 6) is one scale unit; above 6 units, the distance to 6 units
    bound = step_unit + (weight.abs() - 6 * step_unit).clamp(min=0)
    assert (error <= bound * (1 + 1e-6)).all()
    relative_rms = ((error**2).mean(dim=1).sqrt() / weight.pow(2).mean(dim=1).sqrt())[1:]
    assert relative_rms.max() < 0.2


def test_fake_quantize_keeps_dtype_and_equals_dequantized_codes():
    weight = spread_weight().to(torch.bfloat16)
    fake = fake_quantize_fp4(weight, "nvfp4")
    assert fake.dtype == torch.bfloat16
    assert torch.equal(fake, quantize_nvfp4(weight).dequantize().to(torch.bfloat16))
    assert not torch.equal(fake, weight)


def test_column_by_column_grid_rounding_equals_rtn():
    """GPTQ rounds one column at a time onto fixed group scales; with no error feedback that is plain RTN."""
    weight = spread_weight(seed=4)
    for quantize in (quantize_nvfp4, quantize_mxfp4):
        quantized = quantize(weight)
        group = weight.shape[1] // quantized.scale.shape[1]
        multipliers = effective_group_scales(quantized.scale, quantized.global_scale)
        columns = [quantize_to_grid(weight[:, k], multipliers[:, k // group]) for k in range(weight.shape[1])]
        codes = torch.stack([c for c, _ in columns], dim=1)
        dequantized = torch.stack([d for _, d in columns], dim=1)
        assert torch.equal(pack_fp4(codes), quantized.packed)
        assert torch.equal(dequantized, quantized.dequantize())
        assert torch.equal(codes, quantize_fp4_codes(weight, quantized.scale, quantized.global_scale))


def test_bad_shapes_and_formats_raise_one_clear_error():
    with pytest.raises(CompressError, match="multiple of the group size 16"):
        quantize_nvfp4(torch.randn(4, 40))
    with pytest.raises(CompressError, match="multiple of the group size 32"):
        mxfp4_scales(torch.randn(4, 48))
    with pytest.raises(CompressError, match="2-D"):
        quantize_mxfp4(torch.randn(64))
    with pytest.raises(CompressError, match="unknown FP4 format"):
        fake_quantize_fp4(torch.randn(4, 32), "fp4")
    with pytest.raises(CompressError, match="do not tile"):
        quantize_fp4_codes(torch.randn(4, 32), torch.zeros(4, 3, dtype=torch.uint8))
