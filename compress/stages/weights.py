"""Shared machinery of the group-wise integer weight quantizers (RTN, AWQ, and later GPTQ)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from compress.base.errors import CompressError
from compress.formats import QuantizedLinear
from compress.formats.moe_experts import ROUTERS, check_weights_handled
from compress.grids.int_grid import WeightScheme, all_finite, check_group_size, matches, quantize, validate_scheme
from compress.grids.sparsity import carry_mask
from compress.model.layer_walk import decoder_layers
from compress.stages.base import LayerContext, Stage
from compress.stages.fp4_weights import Fp4Layers, rtn_fp4
from compress.stages.hessian import input_groups


@dataclass
class WeightQuantConfig:
    bits: int = 4  # bits per weight code
    group_size: int | None = 128  # input weights sharing one scale (null: one scale per output channel)
    symmetric: bool = True  # scale only; false adds a zero point per group
    # modules left as they are: an exact name, a dotted suffix (mlp.down_proj) or re:<regex>
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    format: str = "int"  # int | nvfp4 (e2m1, fp8 group-16 scales + global) | mxfp4 (e2m1, e8m0 group-32 scales)
    activations: str = "none"  # none (16-bit) | fp4 (W4A4: inputs quantized to the weights' FP4 format)

    @property
    def scheme(self) -> WeightScheme:
        return WeightScheme(self.bits, self.group_size, self.symmetric, self.format)


def target_linears(layer: nn.Module, prefix: str, ignore: list[str]) -> dict[str, nn.Linear]:
    """Dense linears of a decoder layer that the quantizer should replace, by name relative to the layer; MoE
    routers stay dense (a rounded router picks other experts)."""
    return {
        name: module
        for name, module in layer.named_modules()
        if type(module) is nn.Linear and name not in ROUTERS and not matches(f"{prefix}.{name}", ignore)
    }


def replace_module(root: nn.Module, name: str, new: nn.Module, enforce_mask: bool = True) -> None:
    """Swap ``root.<name>`` for ``new``; an N:M mask on the old module moves over and is re-applied to ``new``'s
    weights, so a quantizer cannot refill pruned weights (its compensation or rounding may have)."""
    carry_mask(root.get_submodule(name), new, enforce_mask)
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


class WeightQuantizerStage(Stage):
    """Base for stages that turn a layer's linears into ``QuantizedLinear``; subclasses choose how."""

    quantizes_weights = True
    formats: tuple[str, ...] = ("int",)  # weight formats the stage can produce (WeightScheme.format)

    def __init__(self, config):
        super().__init__(config)
        scheme = config.scheme
        self.fp4 = None if scheme.format == "int" else Fp4Layers(scheme.format, config.activations == "fp4")
        if self.fp4 is not None and self.fp4.needs_calibration:
            self.needs_calibration = True

    def prepare(self, model: nn.Module) -> None:
        scheme = self.config.scheme
        if scheme.format not in self.formats:
            raise CompressError(
                f"{self.name} writes format {' | '.join(self.formats)} weights, not format={scheme.format}"
            )
        activations = getattr(self.config, "activations", "none")
        if activations not in ("none", "fp4") or (activations == "fp4" and scheme.format == "int"):
            raise CompressError(
                f"activations={activations!r}: use none, or fp4 with format=nvfp4/mxfp4 (W4A4 quantizes inputs to "
                "the weights' FP4 format)"
            )
        validate_scheme(scheme)
        check_weights_handled(model, self.name)
        self.stats: dict[str, dict] = {}
        for index, layer in enumerate(decoder_layers(model)):
            for name, linear in target_linears(layer, f"model.layers.{index}", self.config.ignore).items():
                check_group_size(f"model.layers.{index}.{name}", linear.in_features, self.config.scheme)

    def quantize_linear(
        self,
        layer: nn.Module,
        name: str,
        full_name: str,
        clip: torch.Tensor | float = 1.0,
        inputs: torch.Tensor | None = None,
        scale_dtype: torch.dtype | None = None,
        scheme: WeightScheme | None = None,
    ) -> None:
        """Replace ``layer.<name>`` with its quantized form (``scheme``, default the stage's; scales in
        ``scale_dtype``, default the weight's); record the weight (and output, given inputs) error."""
        linear = layer.get_submodule(name)
        weight = linear.weight.data
        if not all_finite(weight):
            raise CompressError(f"{full_name}: weight holds NaN/inf; the model or an earlier stage is broken")
        scheme = scheme or self.config.scheme
        codes, scale, zero = quantize(weight, scheme, clip, scale_dtype=scale_dtype or weight.dtype)
        bias = None if linear.bias is None else linear.bias.data
        quantized = QuantizedLinear.from_codes(codes, scale, zero, scheme.bits, scheme.group_for(weight.shape[1]), bias)
        error = (quantized.dequantized_weight().float() - weight.float()).pow(2).mean() / weight.float().pow(2).mean()
        self.stats[full_name] = {"weight_rel_mse": float(error)}
        replace_module(layer, name, quantized.to(weight.device))

    def quantize_fp4_layer(self, ctx: LayerContext) -> None:
        """Round-to-nearest FP4 for every target of the layer; linears sharing an input are stacked so NVFP4 gives
        them one global scale."""
        targets = target_linears(ctx.layer, ctx.name, self.config.ignore)
        self.fp4.observe(ctx, targets)
        for names in input_groups(targets):
            linears = [targets[name] for name in names]
            weight = torch.cat([linear.weight.data for linear in linears])
            if not all_finite(weight):
                raise CompressError(
                    f"{ctx.name}.{names[0]}: weight holds NaN/inf; the model or an earlier stage is broken"
                )
            codes, scale, global_scale = rtn_fp4(weight.to(ctx.dtype), self.fp4.fmt)
            row = 0
            for name, linear in zip(names, linears, strict=True):
                rows = slice(row, row + linear.out_features)
                row += linear.out_features
                module = self.fp4.module(linear, codes[rows], scale[rows], global_scale)
                self.record_and_replace(ctx, name, linear, module)

    def record_and_replace(self, ctx: LayerContext, name: str, linear: nn.Linear, module: nn.Module) -> None:
        """Record the weight error of ``module`` against the dense ``linear`` it replaces, then replace it."""
        dense = linear.weight.data.float()
        error = (module.dequantized_weight().float() - dense).pow(2).mean() / dense.pow(2).mean()
        self.stats[f"{ctx.name}.{name}"] = {"weight_rel_mse": float(error)}
        replace_module(ctx.layer, name, module.to(linear.weight.device))

    def finalize(self, model: nn.Module) -> dict:
        errors = [s["weight_rel_mse"] for s in self.stats.values()]
        return {
            "scheme": self.config.scheme.describe(),
            "quantized_linears": len(self.stats),
            "mean_weight_rel_mse": sum(errors) / max(len(errors), 1),
            "per_layer": self.stats,
        }
