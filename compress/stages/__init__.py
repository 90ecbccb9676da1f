"""Stage registry: the ``type`` a recipe names → the class that implements it."""

from __future__ import annotations

from compress.base.errors import CompressError
from compress.stages.activations import FP8Stage, W8A8Stage
from compress.stages.awq import AWQStage
from compress.stages.base import LayerContext, Stage, prepare_stages
from compress.stages.distill import DistillStage
from compress.stages.gptq import GPTQStage
from compress.stages.kv_scales import KVCacheStage
from compress.stages.lora import LoRAMergeStage
from compress.stages.mixed import MixedStage
from compress.stages.prune import MagnitudePruneStage, SparseGPTStage, WandaStage
from compress.stages.rotate import RotateStage
from compress.stages.rtn import RTNStage
from compress.stages.signround import SignRoundStage
from compress.stages.smoothquant import SmoothQuantStage

STAGES: dict[str, type[Stage]] = {s.name: s for s in (RTNStage, AWQStage, GPTQStage, SignRoundStage, MixedStage)}
STAGES.update({s.name: s for s in (RotateStage, SmoothQuantStage, W8A8Stage, FP8Stage, KVCacheStage)})
STAGES.update({s.name: s for s in (LoRAMergeStage, MagnitudePruneStage, WandaStage, SparseGPTStage, DistillStage)})


def build_stage(args: dict, position: int) -> Stage:
    args = dict(args)
    kind = args.pop("type", None)
    if not isinstance(kind, str) or kind not in STAGES:  # a list or mapping is not a stage name (nor hashable)
        raise CompressError(
            f"stages.{position}: type={kind!r} is not a known stage; available: {', '.join(sorted(STAGES))}"
        )
    return STAGES[kind].from_args(args, position)


def build_chain(stage_args: list[dict]) -> list[Stage]:
    """Instantiate a recipe's stages and reject illegal orders before any work is done."""
    stages = [build_stage(args, position) for position, args in enumerate(stage_args)]
    check_chain(stages)
    return stages


def check_chain(stages: list[Stage]) -> None:
    """Reject an illegal order from the stages' declared flags alone (no stage is named here), so a new stage is
    checked by saying what it does; sets each healing stage's ``teacher_position``."""
    check_quantization_order(stages)
    check_compression_order(stages)


def check_quantization_order(stages: list[Stage]) -> None:
    """One weight quantizer; scale-folding stages (smoothquant) need dense weights, so they go before it, and a stage
    that trains the packed scales needs it before; a KV-cache quantizer may appear once."""
    quantizer: tuple[int, str] | None = None
    kv_stage: tuple[int, str] | None = None
    for position, stage in enumerate(stages):
        if stage.needs_dense_weights and quantizer is not None:
            raise CompressError(
                f"stages.{position} ({stage.name}) folds scales into dense weights, but stages.{quantizer[0]} "
                f"({quantizer[1]}) already quantized them; put {stage.name} before {quantizer[1]}"
            )
        if stage.quantizes_kv_cache:
            if kv_stage is not None:
                raise CompressError(
                    f"stages.{position} ({stage.name}) would overwrite the KV-cache scales of stages.{kv_stage[0]} "
                    f"({kv_stage[1]}); keep one KV-cache quantizer per recipe"
                )
            kv_stage = (position, stage.name)
        if stage.needs_quantized_weights and quantizer is None:
            raise CompressError(
                f"stages.{position} ({stage.name}) trains what a weight quantizer packs, and no stage before it "
                "quantizes weights: put it after one"
            )
        if stage.quantizes_weights:
            if quantizer is not None:
                raise CompressError(
                    f"stages.{position} ({stage.name}) would quantize weights that stages.{quantizer[0]} "
                    f"({quantizer[1]}) already packed; keep one weight quantizer per recipe"
                )
            quantizer = (position, stage.name)


def check_compression_order(stages: list[Stage]) -> None:
    """Adapters merge into dense weights, pruning precedes quantization (codes cannot be re-pruned), and
    distillation needs something compressed to heal; its teacher is the model just before the first compression."""
    compressed: tuple[int, str] | None = None
    pruner: tuple[int, str] | None = None
    for position, stage in enumerate(stages):
        if stage.merges_adapters and compressed is not None:
            raise CompressError(
                f"stages.{position} ({stage.name}) comes after stages.{compressed[0]} ({compressed[1]}); merge "
                "adapters first, into the dense weights, then prune/quantize"
            )
        if stage.prunes_weights:
            if pruner is not None:
                raise CompressError(f"stages.{position} ({stage.name}): stages.{pruner[0]} already prunes; keep one")
            if compressed is not None:
                raise CompressError(
                    f"stages.{position} ({stage.name}) would prune weights that stages.{compressed[0]} "
                    f"({compressed[1]}) already quantized; put the pruner before the quantizer"
                )
            pruner = (position, stage.name)
        if stage.heals:
            if compressed is None:
                raise CompressError(
                    f"stages.{position} ({stage.name}) has nothing to heal: put it after a pruning or quantizing stage"
                )
            stage.teacher_position = compressed[0]
        if compressed is None and (stage.prunes_weights or stage.quantizes_weights):
            compressed = (position, stage.name)


__all__ = [
    "STAGES",
    "LayerContext",
    "Stage",
    "build_chain",
    "build_stage",
    "check_chain",
    "check_compression_order",
    "check_quantization_order",
    "prepare_stages",
]
