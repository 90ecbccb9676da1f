"""FP4 weight quantization (NVFP4, MXFP4), the compression side: scales from amax (RTN), codes, packing, fake quant.

Every step replays compressed-tensors 0.20's arithmetic for an fp32, bf16 or fp16 weight (``calculate_qparams``,
``generate_gparam``, ``quantize`` and the pack-quantized compressors), so what we write loads there byte for byte:

* NVFP4 (groups of 16): ``global_scale = 448 * 6 / amax(W)`` (fp32 ``[1]``, 1.0 if not finite); this division and
  ``amax(group) / 6`` happen in the weight's dtype, then the product is fp32;
  ``scale = fp8_e4m3(clamp(global_scale * (amax(group) / 6), ±448))``, 0 -> 0.125 (fp8 eps);
  ``code = e2m1(clamp(w / (scale / global_scale), ±6))``.
* MXFP4 (groups of 32): ``e = biased exponent of amax(group) rounded to a power of two (up from mantissa 1.75)
  minus 2``, clamped to 0..255, stored as uint8; ``code = e2m1(clamp(w / 2**(e-127), ±6))``.

e2m1 rounding is to nearest, ties to the even code, keeping the sign (a small negative becomes -0.0, code 0x8,
exactly as compressed-tensors emits). The layout itself (packing, decoding) lives in :mod:`compress.kernels.fp4`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compress.base.errors import CompressError
from compress.kernels.fp4 import (
    E2M1_MAX,
    E8M0_BIAS,
    FP8_SCALE,
    MXFP4_GROUP,
    NVFP4_GROUP,
    dequantize_fp4_reference,
    effective_group_scales,
    pack_fp4,
)

FP8_SCALE_MAX = 448.0
FP8_SCALE_EPS = 0.125  # compressed-tensors' replacement for an all-zero group's fp8 scale
MX_EXPONENT_OFFSET = 2  # floor(log2(6)): maps the group max into e2m1's top binade


@dataclass(frozen=True)
class Fp4Weight:
    """A quantized weight in checkpoint layout: ``weight_packed``, ``weight_scale`` and (NVFP4)
    ``weight_global_scale``."""

    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None

    def dequantize(self) -> torch.Tensor:
        return dequantize_fp4_reference(self.packed, self.scale, self.global_scale)


def e2m1_round(values: torch.Tensor) -> torch.Tensor:
    """fp32 ``values`` (already divided by their scale) rounded to the nearest e2m1 value, saturating at ±6, ties to
    the even code, sign kept (a small negative gives -0.0).

    Arithmetic rather than a search over the grid (it runs on every W4A4 activation): the grid's spacing is 0.5
    below 2, 1 below 4 and 2 up to 6, so dividing by the spacing of the magnitude's range and rounding half to even
    lands on the grid, and the even multiples of each spacing are exactly the even codes."""
    magnitude = values.float().abs().clamp(max=E2M1_MAX)
    spacing = torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))
    return torch.copysign(torch.round(magnitude / spacing) * spacing, values.float())


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """uint8 codes of :func:`e2m1_round`'s values: ``sign << 3 | index`` into the grid."""
    return _codes_of_rounded(e2m1_round(values))


def _codes_of_rounded(rounded: torch.Tensor) -> torch.Tensor:
    """uint8 codes of values already on the e2m1 grid."""
    magnitude = rounded.abs()
    index = torch.where(magnitude < 2, magnitude * 2, torch.where(magnitude < 4, magnitude + 2, magnitude / 2 + 4))
    return index.to(torch.uint8) | (torch.signbit(rounded).to(torch.uint8) << 3)


def _groups(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 ``[N, K/group, group]`` view of a 2-D weight, or one clear error."""
    if weight.dim() != 2:
        raise CompressError(f"FP4 quantizes 2-D weights, got shape {tuple(weight.shape)}; flatten it to [out, in]")
    if weight.shape[1] % group_size:
        raise CompressError(
            f"FP4 needs the input dim ({weight.shape[1]}) to be a multiple of the group size {group_size}; "
            "leave this layer unquantized (ignore it in the recipe)"
        )
    return weight.float().reshape(weight.shape[0], -1, group_size)


def nvfp4_global_scale(weight: torch.Tensor) -> torch.Tensor:
    """fp32 ``[1]``: ``448 * 6 / amax``, so the largest group's fp8 scale lands on 448 (1.0 for a zero weight).
    Divided in the weight's own dtype and then widened, as compressed-tensors' ``generate_gparam`` does for the
    min/max an observer hands it (a bf16 weight gets a bf16-rounded global scale)."""
    amax = weight.abs().amax().clamp(min=torch.finfo(weight.dtype).tiny)
    scale = torch.nan_to_num(FP8_SCALE_MAX * E2M1_MAX / amax, nan=1.0, posinf=1.0, neginf=1.0)
    return scale.float().reshape(1)


def nvfp4_scales(weight: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn ``[N, K/16]`` group scales, to be divided by ``global_scale`` when used. ``amax / 6`` is
    taken in the weight's dtype (exact amax, rounded quotient), as compressed-tensors' ``calculate_qparams`` does."""
    amax = _groups(weight, NVFP4_GROUP).abs().amax(dim=-1).to(weight.dtype)
    scale = global_scale.float() * (amax / E2M1_MAX)
    scale = scale.clamp(-FP8_SCALE_MAX, FP8_SCALE_MAX).to(FP8_SCALE)
    return torch.where(scale.float() == 0, torch.tensor(FP8_SCALE_EPS, dtype=FP8_SCALE, device=scale.device), scale)


def mxfp4_scales(weight: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 ``[N, K/32]`` exponents (bias 127) of power-of-two group scales."""
    amax = _groups(weight, MXFP4_GROUP).abs().amax(dim=-1)
    # Round to a power of two on the bits: add a quarter of the mantissa range, keep sign and exponent.
    bits = (amax.view(torch.int32) + (1 << 21)) & 0x7F800000
    return ((bits >> 23) - MX_EXPONENT_OFFSET).clamp(0, 255).to(torch.uint8)


def quantize_fp4_codes(
    weight: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """uint8 codes ``[N, K]`` of ``weight`` on given group scales (NVFP4 fp8 + global, or MXFP4 e8m0)."""
    if scale.dim() != 2 or scale.shape[0] != weight.shape[0] or weight.shape[-1] % max(scale.shape[-1], 1):
        raise CompressError(f"FP4 scales {tuple(scale.shape)} do not tile the weight {tuple(weight.shape)}")
    effective = effective_group_scales(scale, global_scale)
    grouped = _groups(weight, weight.shape[1] // scale.shape[1])
    return e2m1_codes(grouped / effective[..., None]).reshape(weight.shape)


def quantize_nvfp4(weight: torch.Tensor) -> Fp4Weight:
    """RTN NVFP4: global scale, fp8 group scales, packed codes."""
    global_scale = nvfp4_global_scale(weight)
    scale = nvfp4_scales(weight, global_scale)
    return Fp4Weight(pack_fp4(quantize_fp4_codes(weight, scale, global_scale)), scale, global_scale)


def quantize_mxfp4(weight: torch.Tensor) -> Fp4Weight:
    """RTN MXFP4: e8m0 group scales, packed codes."""
    scale = mxfp4_scales(weight)
    return Fp4Weight(pack_fp4(quantize_fp4_codes(weight, scale)), scale, None)


def fake_quantize_fp4(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """``weight`` quantized RTN to ``fmt`` (``nvfp4`` | ``mxfp4``) and dequantized, in the weight's dtype."""
    quantizers = {"nvfp4": quantize_nvfp4, "mxfp4": quantize_mxfp4}
    if fmt not in quantizers:
        raise CompressError(f"unknown FP4 format {fmt!r}; use one of {sorted(quantizers)}")
    return quantizers[fmt](weight).dequantize().to(weight.dtype)


def quantize_to_grid(values: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``values`` onto the FP4 grid of ``scale`` (the effective fp32 multiplier, broadcastable; e.g. one
    weight column ``[N]`` and its rows' group scales ``[N]``): returns (uint8 codes, dequantized fp32 values).
    The step GPTQ takes per column, with the same rounding as :func:`quantize_nvfp4` / :func:`quantize_mxfp4`."""
    scale = scale.float()
    rounded = e2m1_round(values.float() / scale)  # the grid value itself: no decode of the codes needed
    return _codes_of_rounded(rounded), rounded * scale


FP4_GROUPS = {"nvfp4": NVFP4_GROUP, "mxfp4": MXFP4_GROUP}


def stored_group_scales(effective: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    """The checkpoint form of fp32 effective group scales that came from :func:`nvfp4_scales` / :func:`mxfp4_scales`
    (possibly clipped): ``fp8(effective * global)`` for NVFP4, the e8m0 exponent for MXFP4. Exact for such scales:
    the fp32 round trip moves them far less than the fp8 grid spacing."""
    if global_scale is None:
        return (torch.log2(effective.float()).round() + E8M0_BIAS).clamp(0, 255).to(torch.uint8)
    return (effective.float() * global_scale.float()).clamp(-FP8_SCALE_MAX, FP8_SCALE_MAX).to(FP8_SCALE)


def fake_quantize_fp4_activations(x: torch.Tensor, fmt: str, global_scale: torch.Tensor | None) -> torch.Tensor:
    """``x [..., K]`` quantized per token and group (16 with NVFP4's calibrated ``global_scale``, 32 with MXFP4's
    power-of-two scales) and dequantized, in ``x.dtype``: compressed-tensors' dynamic (``local``) activation scales,
    the W4A4 input a kernel with FP4 tensor cores would see."""
    rows = x.reshape(-1, x.shape[-1])
    scale = mxfp4_scales(rows) if fmt == "mxfp4" else nvfp4_scales(rows, global_scale)
    effective = effective_group_scales(scale, global_scale if fmt == "nvfp4" else None)[..., None]
    values = e2m1_round(_groups(rows, FP4_GROUPS[fmt]) / effective) * effective
    return values.to(x.dtype).reshape(x.shape)
