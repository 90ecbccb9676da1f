"""SmoothQuant (Xiao et al. 2022): move activation outliers into the weights before W8A8 quantization.

Per-token int8 activations lose the small channels of a token whose few outlier channels set the scale. Dividing
input channel ``j`` by ``s_j = max|X_j|^α / max|W_j|^(1-α)`` and multiplying the weights reading it by ``s_j``
leaves the float model unchanged but evens out activation ranges (α → 1 pushes more difficulty into the weights).
The division is folded into the RMSNorm feeding the linears (per family: ``compress.stages.mappings``), so
inference pays nothing. This stage changes no module types: a weight/activation quantizer (``w8a8``, ``fp8``) must
follow it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from compress.base import distributed
from compress.base.errors import CompressError
from compress.formats.moe_experts import check_weights_handled
from compress.grids.int_grid import matches
from compress.model.layer_walk import observe_inputs
from compress.stages.base import LayerContext, LayerWork, Stage
from compress.stages.mappings import family_mappings, fold_scale, layer_mappings, scale_search_bytes


@dataclass
class SmoothQuantConfig:
    alpha: float = 0.5  # migration strength: higher moves more of the activations' range into the weights
    # modules left as they are: an exact name, a dotted suffix (mlp.down_proj) or re:<regex>
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])

    def __post_init__(self):
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha={self.alpha} must be in [0, 1]")


class SmoothQuantStage(Stage):
    name = "smoothquant"
    Config = SmoothQuantConfig
    needs_dense_weights = True  # folds scales into weights: illegal once they are quantized

    def working_bytes(self, work: LayerWork) -> float:
        return scale_search_bytes(work)

    def prepare(self, model: nn.Module) -> None:
        check_weights_handled(model, self.name)
        family = family_mappings(model, "SmoothQuant", norms_only=True)
        self.mappings, self.norm_offset = family.mappings, family.norm_offset
        self.smoothed: dict[str, dict] = {}

    @torch.no_grad()
    def process_layer(self, ctx: LayerContext) -> None:
        if ctx.inputs is None:
            raise CompressError("SmoothQuant needs calibration inputs")
        mappings = [
            m
            for m in layer_mappings(ctx.layer, self.mappings)
            if not any(matches(f"{ctx.name}.{n}", self.config.ignore) for n in m.linears)
        ]
        maxima = self._activation_maxima(ctx, [m.linears[0] for m in mappings])
        for mapping in mappings:
            linears = [ctx.layer.get_submodule(n) for n in mapping.linears]
            if not all(type(linear) is nn.Linear for linear in linears):
                raise CompressError(
                    f"{ctx.name}.{mapping.linears[0]} is already quantized; put smoothquant before the quantizer"
                )
            weight_max = torch.stack([lin.weight.abs().amax(0) for lin in linears]).amax(0).float()
            act_max = maxima[mapping.linears[0]]
            alpha = self.config.alpha
            scale = (act_max.pow(alpha) / weight_max.pow(1 - alpha).clamp(min=1e-5)).clamp(min=1e-5)
            scale = torch.where(act_max > 0, scale, torch.ones_like(scale))  # a silent channel keeps its scale
            fold_scale(ctx.layer, mapping, scale, scale, ctx.model_config, self.norm_offset)
            before = act_max.max() / act_max.clamp(min=1e-8).median()
            after = (act_max / scale).max() / (act_max / scale).clamp(min=1e-8).median()
            self.smoothed[f"{ctx.name}.{mapping.previous}"] = {
                "activation_max_over_median_before": float(before),
                "after": float(after),
            }

    def _activation_maxima(self, ctx: LayerContext, names: list[str]) -> dict[str, torch.Tensor]:
        """Per-input-channel max |x| of each named linear over every calibration token."""
        maxima: dict[str, torch.Tensor] = {}

        def observer(name):
            def observe(x: torch.Tensor) -> None:
                peak = x.abs().amax(0)
                maxima[name] = peak if name not in maxima else torch.maximum(maxima[name], peak)

            return observe

        observe_inputs(ctx.layer, ctx.inputs, ctx.name, {n: observer(n) for n in names})
        return {name: distributed.all_reduce_max(peak) for name, peak in maxima.items()}

    def finalize(self, model: nn.Module) -> dict:
        return {"alpha": self.config.alpha, "smoothed_norms": len(self.smoothed), "per_norm": self.smoothed}
