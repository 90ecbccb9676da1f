"""Integer weight quantization arithmetic shared by every weight quantizer (RTN, AWQ, GPTQ...).

Codes are signed (``[-2**(b-1), 2**(b-1)-1]``) as compressed-tensors stores them. Symmetric: ``w ≈ q * s`` with
``s = absmax / ((2**b - 1) / 2)``; asymmetric: ``w ≈ (q - z) * s`` with ``s = (max - min) / (2**b - 1)``.
A ``clip`` ratio (≤ 1) shrinks the range before the scale is taken; that is what AWQ's clipping search tunes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from compress.base.errors import CompressError


@dataclass(frozen=True)
class WeightScheme:
    bits: int = 4
    group_size: int | None = 128  # None: one scale per output channel
    symmetric: bool = True
    format: str = "int"  # int (signed integer codes) | nvfp4 | mxfp4 (e2m1 codes, see compress.grids.fp4_grid)

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def group_for(self, in_features: int) -> int:
        return in_features if self.group_size is None else self.group_size

    def describe(self) -> str:
        if self.format != "int":
            return f"{self.format} e2m1 g{self.group_size}"
        group = "channel" if self.group_size is None else f"g{self.group_size}"
        return f"int{self.bits} {'sym' if self.symmetric else 'asym'} {group}"


FP4_GROUP_SIZES = {"nvfp4": 16, "mxfp4": 32}  # fixed by each format (compress.grids.fp4_grid / compress.kernels.fp4)


def validate_scheme(scheme: WeightScheme) -> None:
    if scheme.format != "int":
        if scheme.format not in FP4_GROUP_SIZES:
            raise CompressError(f"format={scheme.format!r} is unknown; use int, {' or '.join(FP4_GROUP_SIZES)}")
        group = FP4_GROUP_SIZES[scheme.format]
        if (scheme.bits, scheme.group_size, scheme.symmetric) != (4, group, True):
            raise CompressError(
                f"format={scheme.format} is 4-bit symmetric in groups of {group}: set bits=4, group_size={group}, "
                "symmetric=true"
            )
        return
    if not 2 <= scheme.bits <= 8:
        raise CompressError(f"bits={scheme.bits} is not supported; use 2..8")
    if scheme.group_size is not None and scheme.group_size < 1:
        raise CompressError(f"group_size={scheme.group_size} must be positive, or null for per-channel scales")


def fitting_group_sizes(in_features: int) -> list[int]:
    return [size for size in (16, 32, 64, 128, 256, 512) if in_features % size == 0]


def check_group_size(layer_name: str, in_features: int, scheme: WeightScheme) -> None:
    """A group must tile the input width exactly; say which sizes would fit this layer."""
    if scheme.group_size is not None and in_features % scheme.group_size:
        if scheme.format != "int":
            raise CompressError(
                f"{layer_name}: input width {in_features} is not a multiple of the {scheme.format} group "
                f"({scheme.group_size}); add this layer to the stage's ignore list to keep it unquantized"
            )
        fits = fitting_group_sizes(in_features)
        raise CompressError(
            f"{layer_name}: input width {in_features} is not a multiple of group_size={scheme.group_size}; "
            f"sizes that fit: {fits or 'none of 16..512'} (or group_size=null for per-channel scales)"
        )


def _grouped(weight: torch.Tensor, group: int) -> torch.Tensor:
    out_features, in_features = weight.shape
    return weight.reshape(out_features, in_features // group, group)


def quantize(
    weight: torch.Tensor,
    scheme: WeightScheme,
    clip: torch.Tensor | float = 1.0,
    scale_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(codes int8 [out, in], scale [out, groups], zero_point int8 [out, groups] | None)``.

    ``clip`` is a scalar or a ``[out, groups]`` tensor of range ratios. The scale is rounded to ``scale_dtype``
    (the checkpoint's dtype) before codes are computed, so stored codes and scales agree exactly.
    """
    group = scheme.group_for(weight.shape[1])
    w = _grouped(weight.float(), group)
    clip = torch.as_tensor(clip, dtype=torch.float32, device=weight.device)
    if clip.ndim == 2:
        clip = clip.unsqueeze(-1)
    levels = (1 << scheme.bits) - 1
    if scheme.symmetric:
        absmax = w.abs().amax(-1, keepdim=True) * clip
        scale = absmax / (levels / 2)
    else:
        high = w.amax(-1, keepdim=True).clamp(min=0) * clip  # the range keeps 0 so z is a valid code
        low = w.amin(-1, keepdim=True).clamp(max=0) * clip
        scale = (high - low) / levels
    scale = scale.clamp(min=torch.finfo(torch.float16).tiny)
    scale = scale.to(scale_dtype or weight.dtype).float()
    if scheme.symmetric:
        zero = None
        codes = torch.round(w / scale)
    else:
        zero = (scheme.qmin - torch.round(low / scale)).clamp(scheme.qmin, scheme.qmax)
        codes = torch.round(w / scale) + zero
    codes = codes.clamp(scheme.qmin, scheme.qmax).to(torch.int8).reshape(weight.shape)
    out_dtype = scale_dtype or weight.dtype
    zero_point = None if zero is None else zero.squeeze(-1).to(torch.int8)
    return codes, scale.squeeze(-1).to(out_dtype), zero_point


def fake_quantize(weight: torch.Tensor, scheme: WeightScheme, clip: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Quantize then dequantize in fp32: the weight the quantized layer will compute with.

    Same arithmetic as ``compress.kernels.dequant.dequantize_codes(*quantize(...), group)`` (the one dequantization
    reference) with fp32 scales, without the int8 round trip: searches call this hundreds of times per layer.
    """
    group = scheme.group_for(weight.shape[1])
    w = _grouped(weight.float(), group)
    if isinstance(clip, torch.Tensor) and clip.ndim == 2:
        clip = clip.unsqueeze(-1)
    levels = (1 << scheme.bits) - 1
    tiny = torch.finfo(torch.float16).tiny
    if scheme.symmetric:
        scale = (w.abs().amax(-1, keepdim=True) * clip / (levels / 2)).clamp_(min=tiny)
        return (torch.round(w / scale).clamp_(scheme.qmin, scheme.qmax) * scale).reshape(weight.shape)
    high = w.amax(-1, keepdim=True).clamp_(min=0) * clip
    low = w.amin(-1, keepdim=True).clamp_(max=0) * clip
    scale = ((high - low) / levels).clamp_(min=tiny)
    zero = (scheme.qmin - torch.round(low / scale)).clamp_(scheme.qmin, scheme.qmax)
    codes = (torch.round(w / scale) + zero).clamp_(scheme.qmin, scheme.qmax)
    return ((codes - zero) * scale).reshape(weight.shape)


def matches(name: str, patterns: list[str]) -> bool:
    """``ignore`` semantics: exact module name, a dotted suffix of it (``lm_head``, ``mlp.down_proj``),
    or ``re:<regex>`` searched in the full name."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.search(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or inf in ``tensor``: its minimum and maximum are finite (NaN propagates through both). Two reductions
    instead of ``isfinite(t).all()``'s full boolean copy: 20x faster, and every weight of a model is checked."""
    if tensor.numel() == 0:
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(tensor))).all())
