"""Round-to-nearest: every group's range mapped onto the integer (or FP4) grid, no calibration. The baseline to beat."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from compress.base.errors import CompressError
from compress.stages.base import LayerContext, Stage
from compress.stages.weights import WeightQuantConfig, WeightQuantizerStage, target_linears


@dataclass
class RTNConfig(WeightQuantConfig):
    pass


class RTNStage(WeightQuantizerStage):
    name = "rtn"
    Config = RTNConfig
    needs_calibration = False  # except NVFP4 W4A4, whose input global scales are calibrated
    runs_model_free = True
    formats = ("int", "nvfp4", "mxfp4")

    def algorithm(self) -> str:
        return f"round-to-nearest, {self.config.scheme.describe()}"

    def process_layer(self, ctx: LayerContext) -> None:
        if self.fp4 is not None:
            self.quantize_fp4_layer(ctx)
            return
        for name in target_linears(ctx.layer, ctx.name, self.config.ignore):
            self.quantize_linear(ctx.layer, name, f"{ctx.name}.{name}", scale_dtype=ctx.dtype)

    def quantized_copies(self, model: nn.Module) -> Callable[[int, nn.Module], nn.Module] | None:
        """``(index, decoder layer) -> its quantized copy``, for an evaluation that streams ``model`` layer by layer
        (``compress.evals.perplexity.streamed_perplexity``): the model stays as on disk and the quantized model never
        exists whole. None for FP4 formats, whose W4A4 input scales need calibration inputs."""
        self.prepare(model)
        if self.fp4 is not None:
            return None
        storage_dtype = getattr(model, "dtype", torch.float32)  # what the scales round to, as in the layer walk

        def quantized(index: int, layer: nn.Module) -> nn.Module:
            layer = copy.deepcopy(layer)
            cpu = torch.device("cpu")  # streamed evaluations run on the CPU
            self.process_layer(
                LayerContext(index, f"model.layers.{index}", layer, model.config, None, cpu, storage_dtype)
            )
            return layer

        return quantized


def rtn_reference(stages: list[Stage]) -> RTNStage:
    """Round-to-nearest on the same grid as the chain's weight quantizer: the floor a calibrated method must beat
    (the run's ``eval.reference=rtn``)."""
    quantizer = next((s for s in stages if s.quantizes_weights), None)
    if quantizer is None or not all(hasattr(quantizer.config, k) for k in ("bits", "group_size", "symmetric")):
        raise CompressError(
            "eval.reference=rtn needs an integer weight quantizer in the recipe (awq, gptq, rtn) to copy its scheme; "
            "set eval.reference=null"
        )
    c = quantizer.config
    fp4 = {"format": getattr(c, "format", "int"), "activations": getattr(c, "activations", "none")}  # same grid
    return RTNStage(
        RTNConfig(bits=c.bits, group_size=c.group_size, symmetric=c.symmetric, ignore=list(c.ignore), **fp4)
    )
