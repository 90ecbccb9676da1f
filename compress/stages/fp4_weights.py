"""FP4 weights (NVFP4, MXFP4) in the RTN and GPTQ stages: the e2m1 grid GPTQ rounds each column onto, the RTN
quantizer, and the W4A4 input scales.

Linears that read one input (q/k/v, gate/up) are quantized as one stacked matrix, so an NVFP4 group shares one
weight global scale (the smallest of the members', i.e. from the stacked amax): what llm-compressor writes and what
vLLM needs to run them as one fused GEMM. NVFP4 W4A4 calibrates one input global scale per linear from the max |x|
seen on the calibration set (compressed-tensors' ``static_minmax`` observer); its per-group scales are dynamic.
MXFP4's activation scales are all dynamic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from compress.base.errors import CompressError
from compress.formats import Fp4Linear
from compress.grids.fp4_grid import (
    effective_group_scales,
    mxfp4_scales,
    nvfp4_global_scale,
    nvfp4_scales,
    quantize_fp4_codes,
    quantize_to_grid,
    stored_group_scales,
)
from compress.kernels.fp4 import e2m1_to_float, pack_fp4
from compress.model.layer_walk import input_absmax
from compress.stages.base import LayerContext

# Range ratios tried per group: an e4m3 or power-of-two scale is coarse, so a slightly smaller range often rounds
# the group's bulk better (the Hessian-weighted error decides, per row).
FP4_CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8)


@dataclass
class Fp4Grid:
    """GPTQ's rounding hook for FP4 formats: group scales as the RTN quantizer takes them (optionally clipped),
    columns rounded onto ``e2m1 * scale`` with :func:`compress.grids.fp4_grid.quantize_to_grid`."""

    fmt: str
    global_scale: torch.Tensor | None  # NVFP4: fixed from the whole (stacked) weight before any compensation
    clip_search: bool = True

    @classmethod
    def for_weight(cls, weight: torch.Tensor, fmt: str, clip_search: bool = True) -> Fp4Grid:
        return cls(fmt, nvfp4_global_scale(weight) if fmt == "nvfp4" else None, clip_search)

    def scales(self, weight: torch.Tensor) -> torch.Tensor:
        """Stored group scales of ``weight [N, K]`` (fp8 e4m3 or e8m0 uint8)."""
        return nvfp4_scales(weight, self.global_scale) if self.fmt == "nvfp4" else mxfp4_scales(weight)

    def group_scales(self, pending: torch.Tensor, hessian_block: torch.Tensor) -> torch.Tensor:
        """fp32 effective scale ``[N, 1]`` of one group of columns ``pending [N, group]``: per row, the clip ratio
        whose rounding error weighted by the group's Hessian block is smallest."""
        best_error, best = None, None
        for ratio in FP4_CLIP_RATIOS if self.clip_search else (1.0,):
            effective = effective_group_scales(self.scales(pending * ratio), self.global_scale)
            _, values = quantize_to_grid(pending, effective)
            delta = values - pending
            error = ((delta @ hessian_block) * delta).sum(1, keepdim=True)
            if best is None:
                best_error, best = error, effective
                continue
            better = error < best_error
            best_error, best = torch.where(better, error, best_error), torch.where(better, effective, best)
        return best

    @staticmethod
    def round(column: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, dequantized values) of one column on its rows' effective scales."""
        return quantize_to_grid(column, scale)

    @staticmethod
    def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """fp32 weight of e2m1 ``codes [N, K]`` and effective fp32 ``scales [N, K/group]``."""
        group = codes.shape[1] // scales.shape[1]
        return e2m1_to_float(codes.to(torch.uint8)) * scales.float().repeat_interleave(group, dim=1)


def rtn_fp4(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest FP4 of a (stacked) weight: ``(uint8 codes [N, K], stored scales, global scale | None)``,
    compressed-tensors' arithmetic in the weight's own dtype."""
    grid = Fp4Grid.for_weight(weight, fmt, clip_search=False)
    scale = grid.scales(weight)
    return quantize_fp4_codes(weight, scale, grid.global_scale), scale, grid.global_scale


class Fp4Layers:
    """What the RTN and GPTQ stages share for FP4 formats: W4A4 input scales, and the module they build."""

    def __init__(self, fmt: str, quantize_activations: bool):
        self.fmt, self.quantize_activations = fmt, quantize_activations
        self.input_global_scales: dict[nn.Module, torch.Tensor] = {}

    @property
    def needs_calibration(self) -> bool:
        return self.fmt == "nvfp4" and self.quantize_activations

    @torch.no_grad()
    def observe(self, ctx: LayerContext, linears: dict[str, nn.Linear]) -> None:
        """NVFP4 W4A4: each linear's input global scale ``448 * 6 / max|x|`` over the calibration set."""
        if not self.needs_calibration:
            return
        if ctx.inputs is None:
            raise CompressError("nvfp4 with activations=fp4 needs calibration inputs for the input global scales")
        maxima = input_absmax(ctx.layer, ctx.inputs, ctx.name, list(linears))
        for name, linear in linears.items():
            self.input_global_scales[linear] = nvfp4_global_scale(maxima[name].reshape(1))

    def module(
        self, linear: nn.Linear, codes: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None
    ) -> Fp4Linear:
        """The stored form of ``linear``: e2m1 ``codes`` with stored (fp8/e8m0) or effective fp32 ``scale``."""
        if scale.dtype == torch.float32:
            scale = stored_group_scales(scale, global_scale)
        bias = None if linear.bias is None else linear.bias.data
        return Fp4Linear.from_packed(
            pack_fp4(codes.to(torch.uint8)),
            scale,
            global_scale,
            bias,
            self.quantize_activations,
            self.input_global_scales.pop(linear, None),
        )
