"""Shared machinery of the group-wise integer weight quantizers (RTN, AWQ, and later GPTQ)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from compress.calibration import decoder_layers
from compress.errors import CompressError
from compress.moe import ROUTERS, check_weights_handled
from compress.qlinear import QuantizedLinear
from compress.quant import WeightScheme, check_group_size, matches, quantize, validate_scheme
from compress.sparsity import carry_mask
from compress.stages.base import Stage


@dataclass
class WeightQuantConfig:
    bits: int = 4
    group_size: int | None = 128
    symmetric: bool = True
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])

    @property
    def scheme(self) -> WeightScheme:
        return WeightScheme(self.bits, self.group_size, self.symmetric)


def target_linears(layer: nn.Module, prefix: str, ignore: list[str]) -> dict[str, nn.Linear]:
    """Dense linears of a decoder layer that the quantizer should replace, by name relative to the layer; MoE
    routers stay dense (a rounded router picks other experts)."""
    return {
        name: module
        for name, module in layer.named_modules()
        if type(module) is nn.Linear and name not in ROUTERS and not matches(f"{prefix}.{name}", ignore)
    }


def replace_module(root: nn.Module, name: str, new: nn.Module) -> None:
    """Swap ``root.<name>`` for ``new``; an N:M mask on the old module moves over and is re-applied to ``new``'s
    weights, so a quantizer cannot refill pruned weights (its compensation or rounding may have)."""
    carry_mask(root.get_submodule(name), new)
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


class WeightQuantizerStage(Stage):
    """Base for stages that turn a layer's linears into ``QuantizedLinear``; subclasses choose how."""

    quantizes_weights = True

    def prepare(self, model: nn.Module) -> None:
        validate_scheme(self.config.scheme)
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
    ) -> None:
        """Replace ``layer.<name>`` with its quantized form (scales in ``scale_dtype``, default the weight's);
        record the weight (and output, given inputs) error."""
        linear = layer.get_submodule(name)
        weight = linear.weight.data
        if not torch.isfinite(weight).all():
            raise CompressError(f"{full_name}: weight holds NaN/inf; the model or an earlier stage is broken")
        scheme = self.config.scheme
        codes, scale, zero = quantize(weight, scheme, clip, scale_dtype=scale_dtype or weight.dtype)
        bias = None if linear.bias is None else linear.bias.data
        quantized = QuantizedLinear.from_codes(codes, scale, zero, scheme.bits, scheme.group_for(weight.shape[1]), bias)
        error = (quantized.dequantized_weight().float() - weight.float()).pow(2).mean() / weight.float().pow(2).mean()
        self.stats[full_name] = {"weight_rel_mse": float(error)}
        replace_module(layer, name, quantized.to(weight.device))

    def finalize(self, model: nn.Module) -> dict:
        errors = [s["weight_rel_mse"] for s in self.stats.values()]
        return {
            "scheme": self.config.scheme.describe(),
            "quantized_linears": len(self.stats),
            "mean_weight_rel_mse": sum(errors) / max(len(errors), 1),
            "per_layer": self.stats,
        }
