"""Sign-gradient rounding: AutoRound as published (SignRound, Cheng et al., "Optimize Weight Rounding via Signed
Gradient Descent for the Quantization of LLMs", the algorithm of Intel's auto-round).

Round-to-nearest rounds every weight on its own; what matters is the block's *output*. Per decoder layer this stage
learns, together, for every weight an offset V ∈ [-½, ½] added before rounding (so a weight may round the other way)
and for every group a scale α ∈ [½, 1] on its range's maximum and β ∈ [½, 1] on its minimum (init 1: the clipping
of the range), by signed gradient descent on the mean squared error between the quantized layer's output and the
full-precision layer's output. Rounding goes through a straight-through estimator, so the gradient reaches V, α, β.

As published (the defaults of :class:`SignRoundConfig`): 200 steps of 8 sequences, lr = 1/iterations decaying
linearly to 0, the best iterate (lowest minibatch loss) kept, starting from round-to-nearest. The paper calibrates on
512 sequences of 2048 tokens (``data.num_samples``/``data.seq_len``); ``recipes/autoround_int4.yaml`` ships a CPU
preset of fewer, shorter sequences (its comment and docs/quantization.md give its measured cost).

How this implementation is shaped, and why:
- **Two streams.** The walk feeds each layer the outputs of the already-quantized layers before it; the target is
  the full-precision layer on the *full-precision* stream, which this stage carries itself (one extra forward per
  layer). A layer therefore learns to absorb part of its predecessors' error, not only its own.
- **Signed steps**: over the schedule an offset moves at most about ½ (the sum of the decaying steps), enough to
  flip a rounding and no more; the sign makes the step size independent of the gradient's scale.
- **The best iterate is kept**, judged by each step's minibatch loss; round-to-nearest's parameters are the first
  candidate, so the kept iterate never scored worse than them on its minibatch.
- ``init: gptq`` (not AutoRound) starts from GPTQ's solution instead: the previous ``autoround_int4``.

The modules it trains and exports are in :mod:`compress.stages.learned_rounding`: the same ``QuantizedLinear``
(pack-quantized int2-8, symmetric or with zero points) that RTN and GPTQ write, or with ``format: nvfp4`` / ``mxfp4``
the same ``Fp4Linear``; with V = 0 and α = β = 1 the stage reproduces round-to-nearest bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from compress.base import distributed
from compress.base.errors import CompressError
from compress.model.layer_walk import FullPrecisionStream, LayerInputs, checked_output
from compress.stages.base import FP32_BYTES, LayerContext, LayerWork
from compress.stages.fp4_weights import Fp4Grid
from compress.stages.gptq import GPTQConfig, GPTQStage
from compress.stages.hessian import hessian_walk_bytes, hessian_walk_seconds, input_groups
from compress.stages.learned_rounding import LearnedFp4Rounding, LearnedRounding
from compress.stages.weights import WeightQuantConfig, WeightQuantizerStage, target_linears

INITS = ("rtn", "gptq")


@dataclass
class SignRoundConfig(WeightQuantConfig):
    iterations: int = 200  # signed-gradient steps per decoder layer (AutoRound: 200)
    batch_size: int = 8  # calibration sequences per step, across calibration batches if needed (AutoRound: 8)
    lr: float | None = None  # first step size, decaying linearly to 0; None: 1 / iterations (AutoRound)
    tune_clip: bool = True  # also learn each group's min/max scales α, β (AutoRound); false: offsets only
    min_clip: float = 0.5  # the smallest value α and β may take (AutoRound: 0.5)
    init: str = "rtn"  # rtn: start from round-to-nearest (AutoRound) | gptq: refine GPTQ's solution
    seed: int = 0  # draws each step's calibration sequences

    def __post_init__(self):
        if self.iterations < 1:
            raise ValueError(f"iterations={self.iterations} must be at least 1")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be at least 1")
        if self.lr is not None and self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be positive, or null for 1 / iterations")
        if not 0 < self.min_clip <= 1:
            raise ValueError(f"min_clip={self.min_clip} must be in (0, 1]")
        if self.init not in INITS:
            raise ValueError(f"init={self.init!r} must be one of {', '.join(INITS)}")
        if self.activations != "none":
            raise ValueError(
                f"activations={self.activations!r}: signround learns weight rounding only; use activations=none "
                "(W4A16, NVFP4A16, MXFP4A16), or gptq for W4A4"
            )


@contextmanager
def _frozen(layer: nn.Module) -> Iterator[None]:
    """The layer's own parameters take no gradient while the rounding parameters train."""
    flags = [(p, p.requires_grad) for p in layer.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def _rows(value, rows: torch.Tensor, batch: int):
    """``value`` (a tensor, or tuples/lists/dicts of them) restricted to ``rows`` of a batch of ``batch``
    sequences; tensors without that batch dimension (broadcast position embeddings, flags) pass unchanged."""
    if isinstance(value, torch.Tensor):
        return value[rows] if value.ndim and value.shape[0] == batch and batch > 1 else value
    if isinstance(value, tuple | list):
        return type(value)(_rows(v, rows, batch) for v in value)
    if isinstance(value, dict):
        return {k: _rows(v, rows, batch) for k, v in value.items()}
    return value


class SignRoundStage(WeightQuantizerStage):
    name = "signround"
    Config = SignRoundConfig
    formats = ("int", "nvfp4", "mxfp4")
    STEP_EFFICIENCY = 0.5  # small forward + backward batches reach about half the probe's rate (default model)

    def extra_streams(self) -> int:
        return 2  # the full-precision inputs and the layer's full-precision outputs, its targets

    def working_bytes(self, work: LayerWork) -> float:
        """GPTQ's peak (its start) and autograd's: activations of a batch and, per weight, offsets, clipping
        ratios, gradients and the best iterate."""
        autograd = self.config.batch_size * work.seq_len * (12 * work.hidden + 6 * work.widest) * FP32_BYTES
        autograd += 3 * work.layer_params * FP32_BYTES
        return hessian_walk_bytes(work) + autograd

    def layer_seconds(self, work: LayerWork) -> float:
        """GPTQ's start when asked, its own forward, and forward + backward of every step."""
        c = self.config
        steps = c.iterations * 3 * 2 * work.layer_params * c.batch_size * work.seq_len
        start = hessian_walk_seconds(work) + work.forward_seconds() if c.init == "gptq" else 0.0
        return start + work.forward_seconds() + steps / (work.rate * self.STEP_EFFICIENCY)

    def algorithm(self) -> str:
        c = self.config
        start = "GPTQ's solution (true-sequential, clipping search)" if c.init == "gptq" else "round-to-nearest"
        clip = " and min/max scales" if c.tune_clip else ""
        lr = f"{c.lr:g}" if c.lr is not None else f"1/{c.iterations}"
        return (
            f"sign-gradient rounding from {start}: offsets{clip} learned on each layer's output error, "
            f"{c.iterations} steps x {c.batch_size} sequences, lr {lr}, {c.scheme.describe()}"
        )

    def prepare(self, model: nn.Module) -> None:
        super().prepare(model)
        c = self.config
        self.gptq = None
        if c.init == "gptq":  # the same grid, GPTQ's defaults otherwise
            self.gptq = GPTQStage(
                GPTQConfig(
                    bits=c.bits, group_size=c.group_size, symmetric=c.symmetric, ignore=c.ignore, format=c.format
                )
            )
            self.gptq.keep_positions = True
            self.gptq.prepare(model)
        self.full_precision = FullPrecisionStream()
        self.layer_losses: dict[str, dict[str, float]] = {}
        self.step_losses: dict[str, list[float]] = {}  # each step's minibatch loss, per layer (not in the summary)

    def process_layer(self, ctx: LayerContext) -> None:
        if ctx.inputs is None:
            raise CompressError("signround needs calibration inputs")
        _, targets_out = self.full_precision.advance(ctx.layer, ctx.inputs, ctx.index, ctx.name)
        targets = target_linears(ctx.layer, ctx.name, self.config.ignore)
        modules = self._starting_points(ctx, targets)
        with _frozen(ctx.layer):  # before the swap: the rounding parameters are the only ones that train
            for name, module in modules.items():
                _swap(ctx.layer, name, module)
            try:
                self.layer_losses[ctx.name] = self._train(ctx, modules, targets_out)
            finally:
                for name, module in modules.items():
                    _swap(ctx.layer, name, module.linear)
        for name, module in modules.items():
            self.record_and_replace(ctx, name, module.linear, module.export())
        ctx.outputs = None  # GPTQ's (init=gptq) are stale now: the walk recomputes them from the refined layer

    def _starting_points(self, ctx: LayerContext, targets: dict[str, nn.Linear]) -> dict[str, LearnedRounding]:
        """Each target's learnable rounding, from round-to-nearest or from GPTQ's solution (GPTQ runs on the layer
        first, on the same calibration inputs; its modules are then replaced by the refined ones)."""
        scheme = self.config.scheme
        if self.gptq is None and self.fp4 is None:
            return {name: LearnedRounding.nearest(linear, scheme, ctx.dtype) for name, linear in targets.items()}
        if self.gptq is None:  # FP4 from round-to-nearest: siblings that share an input share NVFP4's global scale
            modules = {}
            for names in input_groups(targets):
                stacked = torch.cat([targets[name].weight.data for name in names]).to(ctx.dtype)
                grid = Fp4Grid.for_weight(stacked, self.fp4.fmt, clip_search=False)
                for name in names:
                    modules[name] = LearnedFp4Rounding.nearest_fp4(targets[name], grid, scheme, ctx.dtype, self.fp4)
            return modules
        self.gptq.process_layer(ctx)
        positions, self.gptq.positions = self.gptq.positions, {}
        if self.fp4 is not None:
            return {
                name: LearnedFp4Rounding.from_fp4(
                    linear, ctx.layer.get_submodule(name), positions[name], scheme, ctx.dtype, self.fp4
                )
                for name, linear in targets.items()
            }
        return {
            name: LearnedRounding.starting_from(
                linear, ctx.layer.get_submodule(name), positions[name], scheme, ctx.dtype
            )
            for name, linear in targets.items()
        }

    def _train(self, ctx: LayerContext, modules: dict[str, LearnedRounding], targets: LayerInputs) -> dict:
        """Signed gradient descent on the output error; leaves every module at its best iterate."""
        c = self.config
        params = [p for m in modules.values() for p in m.parameters_to_learn(c.tune_clip)]
        generator = torch.Generator().manual_seed(c.seed * 100_003 + ctx.index)
        losses, best, best_step = [], [p.detach().clone() for p in params], 0
        steps = tqdm(range(c.iterations), desc=f"{ctx.name} signround", unit="step", leave=False)
        with torch.enable_grad():
            walk = steps if distributed.is_main() else range(c.iterations)
            for step, step_size in zip(walk, self.schedule(), strict=True):
                loss = self._minibatch_loss(ctx, targets, generator)
                losses.append(float(distributed.all_reduce_sum(loss.detach().clone())) / distributed.world())
                if losses[-1] < losses[best_step]:
                    best_step = step
                    for p, kept in zip(params, best, strict=True):
                        kept.copy_(p.detach())
                for p in params:
                    p.grad = None
                loss.backward()
                with torch.no_grad():
                    for p in params:
                        p.add_(distributed.all_reduce_sum(p.grad).sign_(), alpha=-step_size)
                    for m in modules.values():
                        m.project(c.min_clip)
        with torch.no_grad():
            for p, kept in zip(params, best, strict=True):
                p.copy_(kept)
        self.step_losses[ctx.name] = losses
        return {"start_loss": losses[0], "best_loss": losses[best_step], "best_step": best_step}

    def schedule(self) -> list[float]:
        """Each step's size: lr (1/iterations unless set) decaying linearly towards 0, AutoRound's schedule."""
        c = self.config
        lr = c.lr if c.lr is not None else 1.0 / c.iterations
        return [lr * (1 - step / c.iterations) for step in range(c.iterations)]

    def _minibatch_loss(self, ctx: LayerContext, targets: LayerInputs, generator: torch.Generator) -> torch.Tensor:
        """Output MSE on ``batch_size`` sequences (at the first step the parameters are round-to-nearest's, so that
        step's loss is the baseline the best iterate must beat). They come from one calibration batch when it holds
        enough; a larger step, as AutoRound's draw from the whole calibration set, takes the rest from other batches,
        all in one graph: one signed step on all of them."""
        count = len(ctx.inputs.hidden)
        first = int(torch.randint(count, (1,), generator=generator))
        batches = [first]
        if self.config.batch_size > ctx.inputs.hidden[first].shape[0]:
            batches += [b for b in torch.randperm(count, generator=generator).tolist() if b != first]
        losses, taken = [], []
        for batch in batches:
            hidden = ctx.inputs.hidden[batch]
            size = hidden.shape[0]
            rows = torch.randperm(size, generator=generator)[: self.config.batch_size - sum(taken)].sort().values
            out = ctx.layer(hidden[rows], **_rows(ctx.inputs.kwargs[batch], rows, size))
            out = checked_output(out[0] if isinstance(out, tuple) else out, ctx.name)
            losses.append(F.mse_loss(out, targets.hidden[batch][rows]))
            taken.append(len(rows))
            if sum(taken) == self.config.batch_size:
                break
        return sum(loss * (n / sum(taken)) for loss, n in zip(losses, taken, strict=True))

    def finalize(self, model: nn.Module) -> dict:
        summary = super().finalize(model)
        ratios = [v["best_loss"] / max(v["start_loss"], 1e-30) for v in self.layer_losses.values()]
        summary.update(
            iterations=self.config.iterations,
            batch_size=self.config.batch_size,
            mean_loss_vs_start=sum(ratios) / max(len(ratios), 1),
            layer_losses=self.layer_losses,
        )
        self.full_precision = FullPrecisionStream()  # frees the last layer's activations
        return summary


def _swap(layer: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(layer.get_submodule(parent_name) if parent_name else layer, child, module)
