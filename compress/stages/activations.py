"""Weight-and-activation quantizers: INT8 W8A8 (``w8a8``) and FP8 e4m3 (``fp8``).

Both store 8-bit per-output-channel weights (compressed-tensors ``int-quantized`` / ``float-quantized``) and quantize
activations per token at run time; FP8 can instead use one calibrated static scale per tensor. The int8 weights come
from GPTQ (error compensation, the default) or round-to-nearest; at 8 bits the grid is fine enough that FP8 weights
need nothing beyond round-to-nearest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from compress.base.errors import CompressError
from compress.formats import Fp8BlockLinear, Fp8Linear, Int8Linear
from compress.formats.moe_experts import check_weights_handled
from compress.grids.int_grid import WeightScheme, all_finite, quantize
from compress.kernels.dtypes import FP8_MAX
from compress.model.layer_walk import input_absmax
from compress.stages.base import LayerContext
from compress.stages.gptq import GPTQStage
from compress.stages.weights import WeightQuantizerStage, replace_module, target_linears


@dataclass
class W8A8Config:
    weights: str = "gptq"  # how the int8 weights are rounded: gptq | rtn
    # modules left as they are: an exact name, a dotted suffix (mlp.down_proj) or re:<regex>
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    block_size: int = 128  # GPTQ weights: columns updated lazily per block
    dampening: float = 0.01  # GPTQ weights: fraction of mean(diag H) added to the diagonal
    max_damp_retries: int = 6  # GPTQ weights: each failed Cholesky multiplies the dampening by 10
    act_order: bool = False  # GPTQ weights: static-group activation order
    clip_search: bool = False  # at 8 bits the absmax range is already right
    true_sequential: bool = True  # GPTQ weights: each linear's inputs gathered after the ones before it are quantized
    input_correction: bool = False  # GPTQ weights: aim at the full-precision outputs (compress/stages/cross_moments.py)

    def __post_init__(self):
        if self.weights not in ("gptq", "rtn"):
            raise ValueError(f"weights={self.weights!r} must be 'gptq' or 'rtn'")
        if not 0 < self.dampening <= 1:
            raise ValueError(f"dampening={self.dampening} must be in (0, 1]")

    # the fixed weight scheme (what GPTQ, the checkpoint summary and an RTN reference read)
    bits = 8
    group_size = None
    symmetric = True

    @property
    def scheme(self) -> WeightScheme:
        return WeightScheme(8, None, True)


class W8A8Stage(GPTQStage):
    """INT8 per-channel symmetric weights + dynamic per-token int8 activations."""

    name = "w8a8"
    Config = W8A8Config
    runs_model_free = True  # with weights=rtn, when it reads no calibration inputs

    def __init__(self, config: W8A8Config):
        super().__init__(config)
        self.needs_calibration = config.weights == "gptq"

    def algorithm(self) -> str:
        weights = self.gptq_options() if self.config.weights == "gptq" else "round-to-nearest"
        return f"W8A8: int8 per-channel weights by {weights}, int8 per-token activations quantized at run time"

    def process_layer(self, ctx: LayerContext) -> None:
        if self.config.weights == "gptq":
            super().process_layer(ctx)
            return
        for name, linear in target_linears(ctx.layer, ctx.name, self.config.ignore).items():
            if not all_finite(linear.weight):
                raise CompressError(f"{ctx.name}.{name}: weight holds NaN/inf; the model or an earlier stage is broken")
            codes, scale, _ = quantize(linear.weight.data, self.config.scheme, scale_dtype=torch.float32)
            module = self.build_module(linear, codes, scale, None, self.config.scheme)
            dense = linear.weight.data.float()
            error = (module.dequantized_weight() - dense).pow(2).mean() / dense.pow(2).mean()
            self.stats[f"{ctx.name}.{name}"] = {"weight_rel_mse": float(error), "hessian_rel_error": float("nan")}
            replace_module(ctx.layer, name, module)

    def build_module(
        self,
        linear: nn.Linear,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        scheme: WeightScheme,
    ) -> nn.Module:
        module = Int8Linear(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype)
        module.weight.copy_(codes)
        module.weight_scale.copy_(scale.float().reshape(-1, 1))
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.data)
        return module.to(linear.weight.device)

    def finalize(self, model: nn.Module) -> dict:
        summary = super().finalize(model)
        summary["scheme"] = f"w8a8 int8 per-channel weights ({self.config.weights}), dynamic per-token activations"
        return summary


@dataclass
class FP8Config:
    activations: str = "dynamic"  # dynamic (per token at run time) | static (one calibrated scale per tensor)
    strategy: str = "channel"  # channel (one weight scale per row) | block (FP8_BLOCK: per 128x128, token-group 128)
    # modules left as they are: an exact name, a dotted suffix (mlp.down_proj) or re:<regex>
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])

    def __post_init__(self):
        if self.activations not in ("dynamic", "static"):
            raise ValueError(f"activations={self.activations!r} must be 'dynamic' or 'static'")
        if self.strategy not in ("channel", "block"):
            raise ValueError(f"strategy={self.strategy!r} must be 'channel' or 'block'")
        if self.strategy == "block" and self.activations != "dynamic":
            raise ValueError(
                "strategy=block quantizes activations per token group at run time: use activations=dynamic"
            )

    scheme = WeightScheme(8, None, True)  # the group-size check in prepare: per channel, always fits


class FP8Stage(WeightQuantizerStage):
    """FP8 e4m3 weights. Per channel: FP8_DYNAMIC (per-token activations) or static per-tensor activations. Per
    128x128 block (``strategy: block``, FP8_BLOCK): activations per token and group of 128 at run time; edge blocks
    of widths that are not multiples of 128 are partial, as compressed-tensors pads them."""

    name = "fp8"
    Config = FP8Config
    runs_model_free = True  # with dynamic activations, when it reads no calibration inputs

    def __init__(self, config: FP8Config):
        super().__init__(config)
        self.needs_calibration = config.activations == "static"

    def prepare(self, model: nn.Module) -> None:
        check_weights_handled(model, self.name)
        self.stats = {}

    @torch.no_grad()
    def process_layer(self, ctx: LayerContext) -> None:
        targets = target_linears(ctx.layer, ctx.name, self.config.ignore)
        input_max = self._input_maxima(ctx, list(targets)) if self.config.activations == "static" else {}
        for name, linear in targets.items():
            if not all_finite(linear.weight):
                raise CompressError(f"{ctx.name}.{name}: weight holds NaN/inf; the model or an earlier stage is broken")
            input_scale = None
            if name in input_max:
                input_scale = (input_max[name] / FP8_MAX).clamp(min=1e-12)
            if self.config.strategy == "block":
                module = Fp8BlockLinear.from_float(linear, scale_dtype=ctx.dtype)  # what compressed-tensors stores
            else:
                module = Fp8Linear.from_float(linear, input_scale)
            dense = linear.weight.data.float()
            error = (module.dequantized_weight() - dense).pow(2).mean() / dense.pow(2).mean()
            self.stats[f"{ctx.name}.{name}"] = {"weight_rel_mse": float(error)}
            if input_scale is not None:
                self.stats[f"{ctx.name}.{name}"]["input_scale"] = float(input_scale)
            replace_module(ctx.layer, name, module)

    def _input_maxima(self, ctx: LayerContext, names: list[str]) -> dict[str, torch.Tensor]:
        if ctx.inputs is None:
            raise CompressError("fp8 with activations=static needs calibration inputs")
        return input_absmax(ctx.layer, ctx.inputs, ctx.name, names)

    def finalize(self, model: nn.Module) -> dict:
        errors = [s["weight_rel_mse"] for s in self.stats.values()]
        return {
            "scheme": f"fp8 e4m3 per-{self.config.strategy} weights, {self.config.activations} activations",
            "quantized_linears": len(self.stats),
            "mean_weight_rel_mse": sum(errors) / max(len(errors), 1),
            "per_layer": self.stats,
        }
