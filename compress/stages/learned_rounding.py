"""The learnable quantized linears of sign-gradient rounding (:mod:`compress.stages.signround`): AutoRound's
parameters, per weight a rounding offset V ∈ [-½, ½], per group a scale α on the range's maximum and β on its minimum
(each in [min_clip, 1]), on the integer grid and on the FP4 (e2m1) grid.

Kept apart from the stage so the stage reads as the training loop it is; with V = 0 and α = β = 1 both modules
export round-to-nearest's (or GPTQ's) codes, scales and zero points bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compress.formats import Fp4Linear, QuantizedLinear
from compress.grids.fp4_grid import e2m1_codes, stored_group_scales
from compress.grids.int_grid import WeightScheme, quantize
from compress.kernels.fp4 import E2M1_MAX, e2m1_to_float, effective_group_scales
from compress.stages.fp4_weights import Fp4Grid, Fp4Layers

TINY = torch.finfo(torch.float16).tiny


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward (the straight-through estimator)."""
    return x + (torch.round(x) - x).detach()


class _FakeQuantize(torch.autograd.Function):
    """``(clamp(round(position · units + V) + z) − z) · s`` and its straight-through gradients in a few fused passes.

    Written out because autograd's version of the same expression allocates a dozen weight-sized temporaries per
    step: on the default model that cost more than the layer's forward and backward on a batch (1.5 s a step).
    Round passes the gradient through; the clamp stops it outside the code range (``mask``)."""

    @staticmethod
    def forward(ctx, position, offset, units, scale, zero, qmin: int, qmax: int):  # noqa: ANN001, ANN205
        rounded = torch.addcmul(offset, position, units).round_()
        if zero is not None:
            rounded += zero
        codes = rounded.clamp(qmin, qmax)
        mask = codes == rounded  # inside the code range: the gradient passes
        if zero is not None:
            codes -= zero
        ctx.save_for_backward(position, units, scale, codes, mask)
        ctx.has_zero = zero is not None
        return codes * scale

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        position, units, scale, codes, mask = ctx.saved_tensors
        need = ctx.needs_input_grad
        grad_scale = (grad * codes).sum(-1, keepdim=True) if need[3] else None
        grad_sum = grad.sum(-1, keepdim=True) if ctx.has_zero and need[4] else None
        inside = (grad * scale).mul_(mask)  # d weight / d (position · units + V), zero where the code was clamped
        grad_units = (inside * position).sum(-1, keepdim=True) if need[2] else None
        grad_zero = None  # + z inside the clamp, − z outside it
        if grad_sum is not None:
            grad_zero = inside.sum(-1, keepdim=True) - scale * grad_sum
        return None, inside if need[1] else None, grad_units, grad_scale, grad_zero, None, None


class LearnedRounding(nn.Module):
    """A linear whose weight is computed on the quantization grid from learnable offsets and min/max scales.

    The starting point is a grid: per group a scale ``s₀`` (and zero point ``z₀``) and each weight's ``position`` in
    units of ``s₀`` (``w / s₀`` for round-to-nearest's grid, GPTQ's compensated weight for its solution). The group's
    range in those units is ``[low, high]`` (``low ≤ 0 ≤ high``, as :func:`compress.grids.int_grid.quantize` takes it);
    AutoRound shrinks it to ``[β·low, α·high]``, which rescales the grid by ``ratio`` (symmetric:
    ``max(α·high, −β·low) / max(high, −low)``; asymmetric: ``(α·high − β·low) / (high − low)``) and moves the
    zero point to where ``β·low`` lands. The weight is ``(clamp(round(position / ratio + V) + z) − z) · s`` with
    ``s = s₀ · ratio`` rounded to the checkpoint's dtype (straight through), so :meth:`export` stores exactly the
    weight this module computed with; at α = β = 1 the ratio is exactly 1."""

    def __init__(
        self,
        linear: nn.Linear,
        position: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        scheme: WeightScheme,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.linear = linear  # frozen: its bias is used, and the exported module replaces it
        self.scheme, self.dtype = scheme, dtype
        out_features, in_features = linear.weight.shape
        self.group = scheme.group_for(in_features)
        groups = in_features // self.group
        position = position.float().reshape(out_features, groups, self.group)
        self.register_buffer("position", position)
        self.register_buffer("base_scale", scale.float().reshape(out_features, groups, 1))
        self.register_buffer("zero", None if zero is None else zero.float().reshape(out_features, groups, 1))
        self.register_buffer("high", position.amax(-1, keepdim=True).clamp(min=0))
        self.register_buffer("low", position.amin(-1, keepdim=True).clamp(max=0))
        self.offset = nn.Parameter(torch.zeros_like(position))
        self.max_scale = nn.Parameter(torch.ones_like(self.base_scale))  # α: the share of the maximum kept
        self.min_scale = nn.Parameter(torch.ones_like(self.base_scale))  # β: the share of the minimum kept

    @classmethod
    def nearest(cls, linear: nn.Linear, scheme: WeightScheme, dtype: torch.dtype) -> LearnedRounding:
        """Starting from round-to-nearest: :func:`compress.grids.int_grid.quantize`'s scales and zero points."""
        _, scale, zero = quantize(linear.weight.data, scheme, scale_dtype=dtype)
        group = scheme.group_for(linear.in_features)
        position = linear.weight.data.float().view(linear.out_features, -1, group) / scale.float().unsqueeze(-1)
        return cls(linear, position, scale, zero, scheme, dtype)

    @classmethod
    def starting_from(
        cls,
        linear: nn.Linear,
        quantized: QuantizedLinear,
        position: torch.Tensor,
        scheme: WeightScheme,
        dtype: torch.dtype,
    ) -> LearnedRounding:
        """Starting from GPTQ's solution: its scales and zero points, and each compensated weight's ``position``
        before GPTQ rounded it (so with V = 0 the codes are GPTQ's, and a weight GPTQ nearly rounded the other way
        is close to flipping, as round-to-nearest's positions are)."""
        return cls(linear, position, quantized.weight_scale, quantized.weight_zero_point, scheme, dtype)

    def parameters_to_learn(self, scales: bool) -> list[nn.Parameter]:
        """V, and α and β when ``scales`` (otherwise they stay at 1 and take no gradient)."""
        self.max_scale.requires_grad_(scales)
        self.min_scale.requires_grad_(scales)
        return [self.offset, self.max_scale, self.min_scale] if scales else [self.offset]

    @torch.no_grad()
    def project(self, min_clip: float) -> None:
        """Back into the published box after a step: V ∈ [-½, ½], α and β ∈ [min_clip, 1]."""
        self.offset.clamp_(-0.5, 0.5)
        self.max_scale.clamp_(min_clip, 1.0)
        self.min_scale.clamp_(min_clip, 1.0)

    def _ratio(self) -> torch.Tensor:
        """The clipped range over the full one (exactly 1 at α = β = 1; 1 for an all-zero group)."""
        if self.scheme.symmetric:
            full = torch.maximum(self.high, -self.low)
            clipped = torch.maximum(self.max_scale * self.high, -self.min_scale * self.low)
        else:
            full = self.high - self.low
            clipped = self.max_scale * self.high - self.min_scale * self.low
        return torch.where(full > 0, clipped / full.clamp(min=TINY), torch.ones_like(full))

    def _weight(self) -> torch.Tensor:
        """The quantized weight [out, groups, group], differentiable in V, α and β."""
        ratio = self._ratio()
        scale = (self.base_scale * ratio).clamp(min=TINY)
        scale = scale + (scale.to(self.dtype).float() - scale).detach()
        units = self.base_scale / scale  # s₀ / s: exactly 1 while the range is unclipped
        zero = self.zero
        if zero is not None:  # the clipped minimum β·low sits on the lowest code, as quantize puts the minimum
            shift = round_ste(self.min_scale * self.low * units) - torch.round(self.low)
            zero = (zero - shift).clamp(self.scheme.qmin, self.scheme.qmax)
        self._stored = (scale, zero)
        return _FakeQuantize.apply(self.position, self.offset, units, scale, zero, self.scheme.qmin, self.scheme.qmax)

    def quantized_weight(self) -> torch.Tensor:
        return self._weight().view_as(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.quantized_weight(), self.linear.bias)

    @torch.no_grad()
    def export(self) -> QuantizedLinear:
        """The stored form: int8 codes (zero point included, as compressed-tensors stores them) and scales, read
        back from the very weight the module computes with."""
        weight = self._weight()
        scale, zero = self._stored
        codes = torch.round(weight / scale)
        if zero is not None:
            codes += zero
        codes = codes.to(torch.int8).view_as(self.linear.weight)
        zero_point = None if zero is None else torch.round(zero).squeeze(-1).to(torch.int8)
        bias = None if self.linear.bias is None else self.linear.bias.data
        stored_scale = scale.squeeze(-1).to(self.dtype)
        return QuantizedLinear.from_codes(codes, stored_scale, zero_point, self.scheme.bits, self.group, bias)


def _e2m1_spacing(magnitude: torch.Tensor) -> torch.Tensor:
    """Distance between neighbouring e2m1 values around ``magnitude``: 0.5 below 2, 1 below 4, 2 above."""
    return torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))


def _e2m1_ste(x: torch.Tensor) -> torch.Tensor:
    """The nearest e2m1 value (saturating at ±6) forward, identity inside the range backward."""
    inside = x.clamp(-E2M1_MAX, E2M1_MAX)
    return inside + (e2m1_to_float(e2m1_codes(inside)) - inside).detach()


class LearnedFp4Rounding(LearnedRounding):
    """The same learned rounding on the FP4 grid (NVFP4, MXFP4): ``position`` is in units of each group's effective
    scale, rounded onto the e2m1 values ``{0, ±0.5, ..., ±6}``. The grid is not uniform, so an offset V moves a weight
    by V times the spacing where it lies: |V| ≤ ½ reaches either neighbour, as on the integer grid. The grid is
    symmetric, so α and β rescale it as on the symmetric integer grid; a clipped scale is rounded through its stored
    form (fp8 times the global scale, or a power of two), straight through, so the export stores the weight this
    module computed with; with V = 0 and α = β = 1 it is round-to-nearest's."""

    def __init__(
        self,
        linear: nn.Linear,
        position: torch.Tensor,
        scale: torch.Tensor,
        global_scale: torch.Tensor | None,
        scheme: WeightScheme,
        dtype: torch.dtype,
        layers: Fp4Layers,
    ):
        super().__init__(linear, position, scale, None, scheme, dtype)
        self.register_buffer("global_scale", global_scale)
        self.layers = layers

    @classmethod
    def nearest_fp4(
        cls, linear: nn.Linear, grid: Fp4Grid, scheme: WeightScheme, dtype: torch.dtype, layers: Fp4Layers
    ) -> LearnedFp4Rounding:
        """From round-to-nearest on ``grid`` (NVFP4: its global scale comes from the stacked siblings)."""
        weight = linear.weight.data.to(dtype)
        scale = effective_group_scales(grid.scales(weight), grid.global_scale)
        position = weight.float().view(linear.out_features, scale.shape[1], -1) / scale.unsqueeze(-1)
        return cls(linear, position, scale, grid.global_scale, scheme, dtype, layers)

    @classmethod
    def from_fp4(
        cls,
        linear: nn.Linear,
        quantized: Fp4Linear,
        position: torch.Tensor,
        scheme: WeightScheme,
        dtype: torch.dtype,
        layers: Fp4Layers,
    ) -> LearnedFp4Rounding:
        """From GPTQ's FP4 solution: its scales, and each compensated weight's position before it was rounded."""
        global_scale = quantized.weight_global_scale
        scale = effective_group_scales(quantized.weight_scale, global_scale)
        return cls(linear, position, scale, global_scale, scheme, dtype, layers)

    def _grid(self) -> tuple[torch.Tensor, torch.Tensor, None]:
        scale = (self.base_scale * self._ratio()).clamp(min=TINY)
        stored = effective_group_scales(
            stored_group_scales(scale.detach().squeeze(-1), self.global_scale), self.global_scale
        )
        scale = scale + (stored.unsqueeze(-1) - scale).detach()
        unrounded = self.position * (self.base_scale / scale)
        return unrounded + self.offset * _e2m1_spacing(unrounded.detach().abs()), scale, None

    def quantized_weight(self) -> torch.Tensor:
        unrounded, scale, _ = self._grid()
        return (_e2m1_ste(unrounded) * scale).view_as(self.linear.weight)

    @torch.no_grad()
    def export(self) -> Fp4Linear:
        """The stored form: packed e2m1 codes, fp8 (or e8m0) group scales, the global scale."""
        unrounded, scale, _ = self._grid()
        codes = e2m1_codes(unrounded).view_as(self.linear.weight)
        return self.layers.module(self.linear, codes, scale.squeeze(-1), self.global_scale)
