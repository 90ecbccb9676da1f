"""Round-to-nearest: every group's range mapped onto the integer (or FP4) grid, no calibration. The baseline to beat."""

from __future__ import annotations

from dataclasses import dataclass

from compress.stages.base import LayerContext
from compress.stages.weights import WeightQuantConfig, WeightQuantizerStage, target_linears


@dataclass
class RTNConfig(WeightQuantConfig):
    pass


class RTNStage(WeightQuantizerStage):
    name = "rtn"
    Config = RTNConfig
    needs_calibration = False  # except NVFP4 W4A4, whose input global scales are calibrated
    formats = ("int", "nvfp4", "mxfp4")

    def process_layer(self, ctx: LayerContext) -> None:
        if self.fp4 is not None:
            self.quantize_fp4_layer(ctx)
            return
        for name in target_linears(ctx.layer, ctx.name, self.config.ignore):
            self.quantize_linear(ctx.layer, name, f"{ctx.name}.{name}", scale_dtype=ctx.dtype)
