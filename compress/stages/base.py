"""The one interface every compression algorithm implements, so a recipe can chain them in any legal order.

Lifecycle, driven by ``compress.compression.in_memory.compress_model``:
1. ``from_args`` validates the recipe's arguments (unknown keys are named with the valid ones);
2. ``prepare(model)`` checks the model fits (shapes, group sizes, mappings) before any expensive work;
3. ``process_layer(ctx)`` runs once per decoder layer, in order, with that layer's calibration inputs when
   ``needs_calibration`` (several consecutive stages share one walk over the layers); a stage that must see the
   whole model at once (``layerwise = False``: adapter merging, distillation) implements ``process_model`` instead;
4. ``finalize(model)`` returns a summary for the report (what was done, per-layer statistics).

A stage also prices its own work for the pre-flight plan (``compress.app.preflight``, which names no stage): its
activation streams, its working memory and its seconds per decoder layer, from a ``LayerWork``, and a whole-model
stage its own memory and seconds from a ``ModelWork``; and it says whether
``compress.compression.model_free`` may run it straight from the weight files (``runs_model_free``).
"""

from __future__ import annotations

import dataclasses
from abc import ABC
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from compress.base.errors import CompressError, did_you_mean, unknown_key_error
from compress.grids.int_grid import matches
from compress.model.layer_walk import LayerInputs

FP32_BYTES = 4
# Reached rate ÷ probe rate for the work every stage shares (a first fit on SmolLM2-135M, fp32, 2 CPU cores): a
# layer's forward on a batch of thousands of tokens runs at about the probe's rate; elementwise work (round-to-nearest)
# is bound by memory, not arithmetic. A stage with its own kind of work declares its own (AWQ, SignRound).
FORWARD_EFFICIENCY = 1.0
ELEMENTWISE_EFFICIENCY = 0.003


@dataclass(frozen=True)
class LayerWork:
    """What the pre-flight plan knows of one decoder layer's work before any weight is read, for a stage to price
    its own: the layer's shape (safetensors headers), the calibration tokens and this machine's fp32 matmul rate."""

    layer_params: int  # one decoder layer's parameters (all experts)
    hidden: int
    linears: list[tuple[int, int]]  # (out, in) of the layer's linears, experts one by one, routers excluded
    tokens: int  # calibration tokens
    seq_len: int  # calibration window length
    rate: float  # the probe's fp32 matmul rate, FLOP/s

    @property
    def widest(self) -> int:
        """The widest input of a linear (Hessians and scale searches are square in it)."""
        return max((i for _, i in self.linears), default=self.hidden)

    @property
    def largest(self) -> int:
        """The most weights of one linear."""
        return max((o * i for o, i in self.linears), default=0)

    def forward_seconds(self) -> float:
        """The layer's forward over every calibration token, at the measured rate."""
        return 2 * self.layer_params * self.tokens / (self.rate * FORWARD_EFFICIENCY)


@dataclass(frozen=True)
class ModelWork:
    """What the plan knows of the whole model, for a stage that works on all of it at once (distillation) to price
    its own work: one layer's work, the layer count, every parameter and the vocabulary."""

    layer: LayerWork
    layers: int
    params: int  # embeddings and head included (a tied head once)
    vocab: int

    @property
    def linear_params(self) -> int:
        """The decoder layers' linear weights: what a weight trainer trains."""
        return self.layers * sum(o * i for o, i in self.layer.linears)

    def forward_seconds(self, tokens: int) -> float:
        """One forward of the whole model over ``tokens`` at the measured rate: every layer and the head."""
        flops = 2 * tokens * (self.layers * self.layer.layer_params + self.layer.hidden * self.vocab)
        return flops / (self.layer.rate * FORWARD_EFFICIENCY)

    def backward_bytes(self, tokens: int) -> float:
        """What autograd keeps of a forward over ``tokens`` for its backward: each linear's input and output in
        every layer and about half as many again for the norms, activation and residual sums between them (fitted
        to a measured distillation, tests/compress/test_plan.py), and the logits with their log-softmax."""
        per_token = 3 * self.layers * sum(o + i for o, i in self.layer.linears) + 2 * self.vocab
        return tokens * per_token * FP32_BYTES


@dataclass
class LayerContext:
    """What a stage sees of one decoder layer."""

    index: int
    name: str  # full module name, e.g. "model.layers.3"
    layer: nn.Module
    model_config: Any
    inputs: LayerInputs | None
    device: torch.device
    dtype: torch.dtype = torch.float32  # the model's storage dtype: the layer is fp32 here, scales round to this
    outputs: LayerInputs | None = None  # set by a stage that computed the layer's outputs as it leaves them


class Stage(ABC):
    """One algorithm; subclasses set ``name``, ``Config`` (a dataclass of its recipe arguments) and the flags."""

    name: ClassVar[str]
    Config: ClassVar[type]
    # What the stage does, declared so that ``build_chain`` can check a recipe's order from these flags alone.
    needs_calibration: ClassVar[bool] = True  # the layer walk captures calibration inputs only if some stage reads them
    layerwise: ClassVar[bool] = True  # False: the stage needs the whole model at once and implements process_model
    quantizes_weights: ClassVar[bool] = False  # packs weights: a second weight quantizer after this one is illegal
    prunes_weights: ClassVar[bool] = False  # sets N:M masks that every later stage must keep; precedes quantizers
    needs_dense_weights: ClassVar[bool] = False  # folds scales into dense weights: must precede the weight quantizer
    quantizes_kv_cache: ClassVar[bool] = False  # calibrates KV-cache scales: one per recipe, its kv_cache_scheme saved
    merges_adapters: ClassVar[bool] = False  # merges adapters into dense weights: must precede any compression
    heals: ClassVar[bool] = False  # trains the compressed model back (distillation): must follow a compression
    needs_quantized_weights: bool = False  # trains what a weight quantizer packed (its scales): must follow one
    # process_layer treats each input group of linears alone, so without calibration inputs it can run from the
    # weight files with no model built (compress.compression.model_free)
    runs_model_free: ClassVar[bool] = False
    teacher_position: int | None = None  # healing stages: set by build_chain to the first compressing stage
    metrics_sink: Callable[[dict[str, float], int], None] | None = None  # step metrics (loss curves) → MLflow
    seconds: float = 0.0  # wall time spent in this stage's own work (the pipeline adds it up for the report)

    def __init__(self, config):
        self.config = config

    @property
    def kv_cache_scheme(self) -> dict | None:
        """The checkpoint's ``kv_cache_scheme`` block; None unless the stage calibrates one (``quantizes_kv_cache``)."""
        return None

    @classmethod
    def valid_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls.Config)]

    @classmethod
    def from_args(cls, args: dict, position: int) -> Stage:
        valid = cls.valid_keys()
        for key in args:
            if key not in valid:
                raise unknown_key_error(f"stages.{position} ({cls.name})", key, valid)
        try:
            return cls(cls.Config(**args))
        except (TypeError, ValueError) as error:
            raise CompressError(f"stages.{position} ({cls.name}): {error}") from error

    def module_patterns(self) -> dict[str, list[str]]:
        """The recipe keys of this stage that name modules by pattern (``ignore`` semantics), each of which must
        match some module: a typo would silently quantize the layer the user meant to keep."""
        return {"ignore": list(self.config.ignore)} if hasattr(self.config, "ignore") else {}

    def algorithm(self) -> str:
        """One line saying exactly what runs, with the settings that change the result (the report quotes it)."""
        return self.name

    def extra_streams(self) -> int:
        """Activation copies the stage keeps beyond the walk's inputs and outputs (full-precision inputs, targets),
        each as large as the calibration activations."""
        return 1 if getattr(self.config, "input_correction", False) else 0

    def working_bytes(self, work: LayerWork) -> float:
        """The stage's own peak memory beyond the layer and the activations: by default a quantized copy of the
        largest linear and its scales."""
        return 2 * work.largest * FP32_BYTES

    def layer_seconds(self, work: LayerWork) -> float:
        """One layer's work in this stage beyond the walk's own forward: by default one forward over the calibration
        tokens when the stage reads them, else an elementwise pass over the weights."""
        if self.needs_calibration:
            return work.forward_seconds()
        return 20 * work.layer_params / (work.rate * ELEMENTWISE_EFFICIENCY)

    def model_working_bytes(self, work: ModelWork) -> float:
        """A whole-model stage's own peak memory beyond the model the walk holds (a teacher, training state): none
        by default."""
        return 0.0

    def model_seconds(self, work: ModelWork) -> float:
        """A whole-model stage's work beyond its ``layer_seconds`` (training steps): none by default."""
        return 0.0

    def prepare(self, model: nn.Module) -> None:  # noqa: B027 - optional hook
        """Fail fast on a model this stage cannot handle."""

    def before_stage(self, model: nn.Module, position: int) -> None:  # noqa: B027 - optional hook
        """Called on every stage just before the chain's stage ``position`` runs (distillation copies its teacher)."""

    def process_layer(self, ctx: LayerContext) -> None:
        """Transform one decoder layer in place (layerwise stages)."""
        raise NotImplementedError(f"{self.name} is a layerwise stage but does not implement process_layer")

    def process_model(self, model: nn.Module, samples: torch.Tensor, device: torch.device) -> None:
        """Transform the whole model in place (``layerwise = False`` stages); ``samples`` are calibration ids."""
        raise NotImplementedError(f"{self.name} is a whole-model stage but does not implement process_model")

    def finalize(self, model: nn.Module) -> dict:
        """Summary for the report."""
        return {}


def prepare_stages(model: nn.Module, stages: list[Stage]) -> None:
    """Before any work: every module pattern of the chain names something in this model, then each stage's own
    ``prepare`` checks."""
    names = [name for name, _ in model.named_modules() if name]
    short = sorted({".".join(name.split(".")[-depth:]) for name in names for depth in (1, 2)})
    for position, stage in enumerate(stages):
        for key, patterns in stage.module_patterns().items():
            for pattern in patterns:
                if not any(matches(name, [pattern]) for name in names):
                    hint = "" if pattern.startswith("re:") else did_you_mean(pattern, short)
                    raise CompressError(
                        f"stages.{position} ({stage.name}): {key} pattern {pattern!r} matches no module of this "
                        f"model{hint}; use a module name, a dotted suffix of one (mlp.down_proj) or re:<regex>"
                    )
    for stage in stages:
        stage.prepare(model)
