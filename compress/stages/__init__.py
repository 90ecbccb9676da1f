"""Stage registry: the ``type`` a recipe names → the class that implements it."""

from __future__ import annotations

from compress.errors import CompressError
from compress.stages.awq import AWQStage
from compress.stages.base import LayerContext, Stage
from compress.stages.gptq import GPTQStage
from compress.stages.rtn import RTNStage

STAGES: dict[str, type[Stage]] = {stage.name: stage for stage in (RTNStage, AWQStage, GPTQStage)}


def build_stage(args: dict, position: int) -> Stage:
    args = dict(args)
    kind = args.pop("type", None)
    if kind not in STAGES:
        raise CompressError(
            f"stages.{position}: type={kind!r} is not a known stage; available: {', '.join(sorted(STAGES))}"
        )
    return STAGES[kind].from_args(args, position)


def build_chain(stage_args: list[dict]) -> list[Stage]:
    """Instantiate a recipe's stages and reject illegal orders before any work is done."""
    stages = [build_stage(args, position) for position, args in enumerate(stage_args)]
    quantizer = None
    for position, stage in enumerate(stages):
        if stage.quantizes_weights:
            if quantizer is not None:
                raise CompressError(
                    f"stages.{position} ({stage.name}) would quantize weights that stages.{quantizer[0]} "
                    f"({quantizer[1]}) already packed; keep one weight quantizer per recipe"
                )
            quantizer = (position, stage.name)
    return stages


__all__ = ["STAGES", "LayerContext", "Stage", "build_chain", "build_stage"]
