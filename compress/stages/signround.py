"""Sign-gradient rounding (SignRound, the algorithm behind Intel's AutoRound, Cheng et al. 2023).

Round-to-nearest rounds every weight on its own; what matters is the layer's *output*. Per decoder layer this stage
learns, for every weight, an offset V ∈ [-½, ½] added before rounding (so a weight may round the other way) and,
for every group, the ratio its range is clipped to, by signed gradient descent on the mean squared error between
the quantized layer's output and the full-precision layer's output. Rounding goes through a straight-through
estimator, so the gradient reaches V.

How this implementation is shaped, and why:
- **Two streams.** The walk feeds each layer the outputs of the already-quantized layers before it; the target is
  the full-precision layer on the *full-precision* stream, which this stage carries itself (one extra forward per
  layer). A layer therefore learns to absorb part of its predecessors' error, not only its own.
- **Signed steps** of ``lr`` (default 1/iterations), decaying linearly to zero: over a schedule an offset moves at
  most about ½, enough to flip a rounding and no more; the sign makes the step size independent of the gradient's
  scale, which differs by orders of magnitude between layers.
- **The best iterate is kept**, judged by each step's minibatch loss (the last one is not the best: the loss is
  noisy); round-to-nearest's parameters are the first candidate, so the kept iterate never scored worse than them.
- **A CPU-sized schedule** by default: few sequences per step and tens of steps, chosen on one layer in
  ``benchmarks/results/signround-layer.md`` (the published default, 200 steps of 8 × 2048 tokens, does not finish
  one layer of the default model in ten minutes on two cores).

The export is the same ``QuantizedLinear`` (pack-quantized int2-8, symmetric or with zero points) that RTN and GPTQ
write, with codes and scales computed by the arithmetic of :func:`compress.grids.int_grid.quantize`, or with ``format:
nvfp4`` / ``mxfp4`` the same ``Fp4Linear`` (e2m1 codes, fp8 or e8m0 group scales): with V = 0 and no clipping the
stage reproduces round-to-nearest bit for bit.
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
from compress.formats import Fp4Linear, QuantizedLinear
from compress.grids.fp4_grid import e2m1_codes, stored_group_scales
from compress.grids.int_grid import WeightScheme, quantize
from compress.kernels.fp4 import E2M1_MAX, e2m1_to_float, effective_group_scales
from compress.model.layer_walk import FullPrecisionStream, LayerInputs, checked_output
from compress.stages.base import FP32_BYTES, LayerContext, LayerWork
from compress.stages.fp4_weights import Fp4Grid, Fp4Layers
from compress.stages.gptq import GPTQConfig, GPTQStage
from compress.stages.hessian import hessian_walk_bytes, hessian_walk_seconds, input_groups
from compress.stages.weights import WeightQuantConfig, WeightQuantizerStage, target_linears

TINY = torch.finfo(torch.float16).tiny
INITS = ("rtn", "gptq")


@dataclass
class SignRoundConfig(WeightQuantConfig):
    iterations: int = 40  # signed-gradient steps per decoder layer
    batch_size: int = 4  # calibration sequences per step (all from one calibration batch)
    lr: float | None = None  # step size; None: 1 / iterations
    tune_clip: bool = True  # also learn each group's clipping ratio (both ends of the range when asymmetric)
    min_clip: float = 0.5  # the smallest ratio a group's range may be clipped to
    init: str = "rtn"  # rtn: start from round-to-nearest (SignRound as published) | gptq: refine GPTQ's solution
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


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward (the straight-through estimator)."""
    return x + (torch.round(x) - x).detach()


class LearnedRounding(nn.Module):
    """A linear whose weight is computed on the quantization grid from learnable offsets and a clipping ratio.

    The starting point is a grid: per group a scale ``s₀`` (and zero point ``z``) and each weight's ``position`` in
    units of ``s₀`` (``w / s₀`` for round-to-nearest's grid, an integer for a solution found by GPTQ). The module
    computes ``(clamp(round(position · s₀ / s + V) + z) − z) · s`` with ``s = s₀ · clip``: ``offset`` is V
    [out, groups, group] and ``clip`` [out, groups, 1] shrinks the group's range around its zero point. ``s`` is
    rounded to the checkpoint's dtype (straight through), so :meth:`export` stores exactly the weight this module
    computed with."""

    def __init__(
        self,
        linear: nn.Linear,
        position: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        scheme: WeightScheme,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.linear = linear  # frozen: its bias is used, and the exported module replaces it
        self.scheme, self.dtype = scheme, dtype
        out_features, in_features = linear.weight.shape
        self.group = scheme.group_for(in_features)
        groups = in_features // self.group
        self.register_buffer("position", position.float().reshape(out_features, groups, self.group))
        self.register_buffer("base_scale", scale.float().reshape(out_features, groups, 1))
        self.register_buffer("zero", None if zero is None else zero.float().reshape(out_features, groups, 1))
        self.offset = nn.Parameter(torch.zeros_like(self.position))
        self.clip = nn.Parameter(torch.ones_like(self.base_scale))

    @classmethod
    def nearest(cls, linear: nn.Linear, scheme: WeightScheme, dtype: torch.dtype) -> LearnedRounding:
        """Starting from round-to-nearest: :func:`compress.grids.int_grid.quantize`'s scales and zero points."""
        _, scale, zero = quantize(linear.weight.data, scheme, scale_dtype=dtype)
        group = scheme.group_for(linear.in_features)
        position = linear.weight.data.float().view(linear.out_features, -1, group) / scale.float().unsqueeze(-1)
        return cls(linear, position, scale, zero, scheme, dtype)

    @classmethod
    def starting_from(
        cls,
        linear: nn.Linear,
        quantized: QuantizedLinear,
        position: torch.Tensor,
        scheme: WeightScheme,
        dtype: torch.dtype,
    ) -> LearnedRounding:
        """Starting from GPTQ's solution: its scales and zero points, and each compensated weight's ``position``
        before GPTQ rounded it (so with V = 0 the codes are GPTQ's, and a weight GPTQ nearly rounded the other way
        is close to flipping, as round-to-nearest's positions are)."""
        return cls(linear, position, quantized.weight_scale, quantized.weight_zero_point, scheme, dtype)

    def _grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes before rounding, scale) at the current clipping ratios."""
        scale = (self.base_scale * self.clip).clamp(min=TINY)
        scale = scale + (scale.to(self.dtype).float() - scale).detach()
        return self.position * (self.base_scale / scale) + self.offset, scale

    def _codes(self, unrounded: torch.Tensor, rounding) -> torch.Tensor:
        codes = rounding(unrounded)
        if self.zero is not None:
            codes = codes + self.zero
        return codes.clamp(self.scheme.qmin, self.scheme.qmax)

    def quantized_weight(self) -> torch.Tensor:
        unrounded, scale = self._grid()
        codes = self._codes(unrounded, _round_ste)
        if self.zero is not None:
            codes = codes - self.zero
        return (codes * scale).view_as(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.quantized_weight(), self.linear.bias)

    @torch.no_grad()
    def export(self) -> QuantizedLinear:
        """The stored form: int8 codes (zero point included, as compressed-tensors stores them) and scales."""
        unrounded, scale = self._grid()
        codes = self._codes(unrounded, torch.round).to(torch.int8).view_as(self.linear.weight)
        zero_point = None if self.zero is None else self.zero.squeeze(-1).to(torch.int8)
        bias = None if self.linear.bias is None else self.linear.bias.data
        stored_scale = scale.squeeze(-1).to(self.dtype)
        return QuantizedLinear.from_codes(codes, stored_scale, zero_point, self.scheme.bits, self.group, bias)


def _e2m1_spacing(magnitude: torch.Tensor) -> torch.Tensor:
    """Distance between neighbouring e2m1 values around ``magnitude``: 0.5 below 2, 1 below 4, 2 above."""
    return torch.where(magnitude < 2, 0.5, torch.where(magnitude < 4, 1.0, 2.0))


def _e2m1_ste(x: torch.Tensor) -> torch.Tensor:
    """The nearest e2m1 value (saturating at ±6) forward, identity inside the range backward."""
    inside = x.clamp(-E2M1_MAX, E2M1_MAX)
    return inside + (e2m1_to_float(e2m1_codes(inside)) - inside).detach()


class LearnedFp4Rounding(LearnedRounding):
    """The same learned rounding on the FP4 grid (NVFP4, MXFP4): ``position`` is in units of each group's effective
    scale, rounded onto the e2m1 values ``{0, ±0.5, ..., ±6}``. The grid is not uniform, so an offset V moves a weight
    by V times the spacing where it lies: |V| ≤ ½ reaches either neighbour, as on the integer grid. A clipped scale
    is rounded through its stored form (fp8 times the global scale, or a power of two), straight through, so the
    export stores the weight this module computed with; with V = 0 and no clipping it is round-to-nearest's."""

    def __init__(
        self,
        linear: nn.Linear,
        position: torch.Tensor,
        scale: torch.Tensor,
        global_scale: torch.Tensor | None,
        scheme: WeightScheme,
        dtype: torch.dtype,
        layers: Fp4Layers,
    ):
        super().__init__(linear, position, scale, None, scheme, dtype)
        self.register_buffer("global_scale", global_scale)
        self.layers = layers

    @classmethod
    def nearest_fp4(
        cls, linear: nn.Linear, grid: Fp4Grid, scheme: WeightScheme, dtype: torch.dtype, layers: Fp4Layers
    ) -> LearnedFp4Rounding:
        """From round-to-nearest on ``grid`` (NVFP4: its global scale comes from the stacked siblings)."""
        weight = linear.weight.data.to(dtype)
        scale = effective_group_scales(grid.scales(weight), grid.global_scale)
        position = weight.float().view(linear.out_features, scale.shape[1], -1) / scale.unsqueeze(-1)
        return cls(linear, position, scale, grid.global_scale, scheme, dtype, layers)

    @classmethod
    def from_fp4(
        cls,
        linear: nn.Linear,
        quantized: Fp4Linear,
        position: torch.Tensor,
        scheme: WeightScheme,
        dtype: torch.dtype,
        layers: Fp4Layers,
    ) -> LearnedFp4Rounding:
        """From GPTQ's FP4 solution: its scales, and each compensated weight's position before it was rounded."""
        global_scale = quantized.weight_global_scale
        scale = effective_group_scales(quantized.weight_scale, global_scale)
        return cls(linear, position, scale, global_scale, scheme, dtype, layers)

    def _grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        scale = (self.base_scale * self.clip).clamp(min=TINY)
        stored = effective_group_scales(
            stored_group_scales(scale.detach().squeeze(-1), self.global_scale), self.global_scale
        )
        scale = scale + (stored.unsqueeze(-1) - scale).detach()
        unrounded = self.position * (self.base_scale / scale)
        return unrounded + self.offset * _e2m1_spacing(unrounded.detach().abs()), scale

    def quantized_weight(self) -> torch.Tensor:
        unrounded, scale = self._grid()
        return (_e2m1_ste(unrounded) * scale).view_as(self.linear.weight)

    @torch.no_grad()
    def export(self) -> Fp4Linear:
        """The stored form: packed e2m1 codes, fp8 (or e8m0) group scales, the global scale."""
        unrounded, scale = self._grid()
        codes = e2m1_codes(unrounded).view_as(self.linear.weight)
        return self.layers.module(self.linear, codes, scale.squeeze(-1), self.global_scale)


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
        clip = " and clipping ratios" if c.tune_clip else ""
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
        params = [p for m in modules.values() for p in (m.offset, m.clip) if p is m.offset or c.tune_clip]
        lr = c.lr if c.lr is not None else 1.0 / c.iterations
        generator = torch.Generator().manual_seed(c.seed * 100_003 + ctx.index)
        best_loss, first_loss, best = float("inf"), None, [p.detach().clone() for p in params]
        steps = tqdm(range(c.iterations), desc=f"{ctx.name} signround", unit="step", leave=False)
        with torch.enable_grad():
            for step in steps if distributed.is_main() else range(c.iterations):
                loss = self._minibatch_loss(ctx, targets, generator)
                value = float(distributed.all_reduce_sum(loss.detach().clone())) / distributed.world()
                if first_loss is None:
                    first_loss = value
                if value < best_loss:
                    best_loss = value
                    best = [p.detach().clone() for p in params]
                for p in params:
                    p.grad = None
                loss.backward()
                with torch.no_grad():
                    step_size = lr * (1 - step / c.iterations)
                    for p in params:
                        p.sub_(step_size * distributed.all_reduce_sum(p.grad).sign())
                    for m in modules.values():
                        m.offset.clamp_(-0.5, 0.5)
                        m.clip.clamp_(c.min_clip, 1.0)
        with torch.no_grad():
            for p, kept in zip(params, best, strict=True):
                p.copy_(kept)
        return {"start_loss": first_loss, "best_loss": best_loss}

    def _minibatch_loss(self, ctx: LayerContext, targets: LayerInputs, generator: torch.Generator) -> torch.Tensor:
        """Output MSE on ``batch_size`` sequences of one calibration batch (at the first step the parameters are
        round-to-nearest's, so that step's loss is the baseline the best iterate must beat)."""
        batch = int(torch.randint(len(ctx.inputs.hidden), (1,), generator=generator))
        hidden = ctx.inputs.hidden[batch]
        size = hidden.shape[0]
        rows = torch.randperm(size, generator=generator)[: self.config.batch_size].sort().values
        out = ctx.layer(hidden[rows], **_rows(ctx.inputs.kwargs[batch], rows, size))
        out = checked_output(out[0] if isinstance(out, tuple) else out, ctx.name)
        return F.mse_loss(out, targets.hidden[batch][rows])

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
