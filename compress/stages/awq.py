"""Activation-aware weight quantization (AWQ, Lin et al. 2023), CPU-capable.

Idea: the few input channels with large activations matter most. Scaling such a channel's weights up by ``s`` (and the
operation feeding it down by ``s``) leaves the float model unchanged but shrinks that channel's relative rounding
error. Per mapping (an operation and the linears it feeds) we search ``s = mean|x|^a / mean|w|^(1-a)`` over a grid of
exponents ``a`` ("duo scaling"; plain ``mean|x|^a`` when off), keeping the identity when nothing beats it, then
search a per-group clipping ratio that minimises each linear's output error, then round to the grid. With
``rounding: gptq`` the scaled linears are rounded by GPTQ instead (true-sequential, its own Hessian-weighted clipping
search): AWQ makes the salient channels coarse-grid friendly, GPTQ then spends each rounding error on the columns not
yet rounded. The two act on different things (the grid's placement, the rounding decisions), so they compose.

Which op feeds which linears, per family (Gemma's (1 + w) norms, Phi-3's fused linears): ``compress.stages.mappings``.

Beyond the paper's recipe: the value→output mapping is applied to grouped-query attention too, by tying the scales of
all query heads that read one KV head (the reference implementations skip it when shapes differ), and every loss is
computed from the input's second moment E[x xᵀ] (as GPTQ does), so it is exact over all calibration tokens and costs
O(in²) per candidate instead of a forward pass: that is what lets AWQ run on 2 CPU cores in minutes.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
from torch import nn

from compress.base import distributed
from compress.base.errors import CompressError
from compress.grids.int_grid import fake_quantize
from compress.model.layer_walk import observe_inputs
from compress.stages.base import LayerContext, LayerWork
from compress.stages.gptq import GPTQConfig, GPTQStage
from compress.stages.hessian import hessian_walk_bytes, hessian_walk_seconds
from compress.stages.mappings import (
    Mapping,
    family_mappings,
    fold_scale,
    layer_mappings,
    previous_width,
    scale_search_bytes,
)
from compress.stages.weights import WeightQuantConfig, WeightQuantizerStage, target_linears


@dataclass
class AWQConfig(WeightQuantConfig):
    grid: int = 20  # exponents a = 0, 1/grid, ..., (grid-1)/grid
    duo_scaling: bool | str = "both"  # true: mean|x|^a / mean|w|^(1-a); false: mean|x|^a; both: search both
    clip: bool = True  # search a clipping ratio per group after scaling
    clip_grid: int = 20  # shrink steps of 1/clip_grid ...
    max_shrink: float = 0.5  # ... down to (1 - max_shrink) of the range
    rounding: str = "rtn"  # rtn: clip search then round to nearest; gptq: GPTQ's error-compensating rounding
    act_order: bool = False  # rounding: gptq's column order (static groups, no g_idx); round-to-nearest has none


NO_CLIP = ("q_proj", "k_proj", "qkv_proj")  # their error passes through softmax, where clipping outliers hurts


@dataclass
class _Activations:
    """First and second moments of a linear's input over every calibration token."""

    mean_abs: torch.Tensor  # [in]: E|x|, what AWQ's scales are made of
    gram: torch.Tensor  # [in, in]: E[x xᵀ], so that E‖x Δᵀ‖² = Σ (Δ G) ⊙ Δ for any weight error Δ


def output_error(delta: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """Mean squared output error of weight error ``delta`` [out, in] over the calibration tokens."""
    return ((delta @ gram) * delta).sum() / delta.shape[0]


class AWQStage(WeightQuantizerStage):
    name = "awq"
    Config = AWQConfig
    SEARCH_EFFICIENCY = 0.5  # candidate errors reach about half the probe's matmul rate (fit on the default model)

    def working_bytes(self, work: LayerWork) -> float:
        if self.config.rounding == "gptq":  # GPTQ's rounding after the search
            return max(scale_search_bytes(work), hessian_walk_bytes(work))
        return scale_search_bytes(work)

    def layer_seconds(self, work: LayerWork) -> float:
        """Its own forward, every candidate scale's (and clipping ratio's) output error, and GPTQ's rounding when
        asked (which does its own clipping search, so AWQ's is skipped)."""
        c = self.config
        gptq_rounding = c.rounding == "gptq"
        candidates = c.grid * (2 if c.duo_scaling == "both" else 1)
        candidates += c.clip_grid if c.clip and not gptq_rounding else 0
        search = sum(candidates * 2 * o * i * i for o, i in work.linears) / (work.rate * self.SEARCH_EFFICIENCY)
        rounding = work.forward_seconds() + hessian_walk_seconds(work) if gptq_rounding else 0.0
        return work.forward_seconds() + search + rounding

    def algorithm(self) -> str:
        c = self.config
        scales = f"AWQ: activation-aware scales (grid {c.grid}, duo scaling {c.duo_scaling})"
        if c.rounding == "gptq":
            return f"{scales}, then {self._rounder().gptq_options()}, {c.scheme.describe()}"
        clip = f", per-group clipping search ({c.clip_grid} steps to {1 - c.max_shrink:g})" if c.clip else ""
        return f"{scales}{clip}, then round-to-nearest, {c.scheme.describe()}"

    def _rounder(self) -> GPTQStage:
        """The GPTQ stage that rounds the scaled linears (``rounding: gptq``), on the same scheme and ignore list."""
        c = self.config
        return GPTQStage(
            GPTQConfig(
                bits=c.bits, group_size=c.group_size, symmetric=c.symmetric, ignore=c.ignore, act_order=c.act_order
            )
        )

    def prepare(self, model: nn.Module) -> None:
        if self.config.duo_scaling not in (True, False, "both"):
            raise CompressError(f"awq: duo_scaling={self.config.duo_scaling!r}; use true, false or both")
        if self.config.rounding not in ("rtn", "gptq"):
            raise CompressError(f"awq: rounding={self.config.rounding!r}; use rtn or gptq")
        family = family_mappings(model, "AWQ")
        self.mappings, self.norm_offset = family.mappings, family.norm_offset
        super().prepare(model)
        self.scaled_mappings = 0
        self.rounder = self._rounder() if self.config.rounding == "gptq" else None
        self.rounding_seconds = 0.0  # of the stage's seconds, GPTQ's rounding; the rest is AWQ's own search
        if self.rounder is not None:
            self.rounder.prepare(model)

    def process_layer(self, ctx: LayerContext) -> None:
        if ctx.inputs is None:
            raise CompressError("AWQ needs calibration inputs")
        targets = target_linears(ctx.layer, ctx.name, self.config.ignore)
        mappings = layer_mappings(ctx.layer, self.mappings)
        activations = self._capture(ctx, mappings)
        input_scale: dict[str, torch.Tensor] = {}
        for mapping in mappings:
            if not all(name in targets for name in mapping.linears):
                continue  # an ignored linear stays dense; scaling it would buy nothing
            scale = self._search_scale(ctx, mapping, activations[mapping.linears[0]])
            if scale is not None:
                self.apply_scale(ctx, mapping, scale)
                self.scaled_mappings += 1
                for name in mapping.linears:
                    input_scale[name] = self._expand(ctx, mapping, scale)
        if self.rounder is not None:  # its Hessians are gathered from the scaled layer, one input group at a time
            start = time.perf_counter()
            self.rounder.process_layer(ctx)  # ends in host reads of its errors: on a GPU the time is its own
            self.rounding_seconds += time.perf_counter() - start
            self.stats.update({f"{ctx.name}.{name}": self.rounder.stats[f"{ctx.name}.{name}"] for name in targets})
            return
        for name in targets:
            owner = next(m for m in mappings if name in m.linears)
            clip = 1.0
            if self.config.clip and not name.endswith(NO_CLIP):
                gram = activations[owner.linears[0]].gram
                if name in input_scale:  # the linear now sees x / s
                    inverse = 1.0 / input_scale[name]
                    gram = gram * inverse[:, None] * inverse[None, :]
                clip = self._search_clip(ctx.layer.get_submodule(name).weight.data, gram)
            self.quantize_linear(ctx.layer, name, f"{ctx.name}.{name}", clip, scale_dtype=ctx.dtype)

    def finalize(self, model: nn.Module) -> dict:
        summary = super().finalize(model)
        if self.rounder is not None:
            summary.update({k: v for k, v in self.rounder.finalize(model).items() if k not in summary})
            summary["rounding_seconds"] = self.rounding_seconds
        return summary

    # -- calibration statistics -------------------------------------------------------------------------------
    @torch.no_grad()
    def _capture(self, ctx: LayerContext, mappings: list[Mapping]) -> dict[str, _Activations]:
        """E|x| and E[x xᵀ] of each mapping's input over all calibration tokens: losses then cost O(in²), not
        O(tokens), and are exact over the whole calibration set rather than a subsample."""
        sums: dict[str, torch.Tensor] = {}
        grams: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}

        def observer(name):
            def observe(x: torch.Tensor) -> None:
                if name not in sums:
                    sums[name] = torch.zeros(x.shape[1], device=x.device)
                    grams[name] = torch.zeros(x.shape[1], x.shape[1], device=x.device)
                    counts[name] = 0
                sums[name] += x.abs().sum(0)
                grams[name].addmm_(x.T, x)
                counts[name] += x.shape[0]

            return observe

        observe_inputs(ctx.layer, ctx.inputs, ctx.name, {m.linears[0]: observer(m.linears[0]) for m in mappings})
        for name in sums:  # the scale and clip searches read only these: reduced, every rank picks the same scales
            distributed.all_reduce_sum(sums[name])
            distributed.all_reduce_sum(grams[name])
            counts[name] = distributed.sum_count(counts[name], sums[name].device)
        return {name: _Activations(sums[name] / counts[name], grams[name] / counts[name]) for name in sums}

    # -- scale search ------------------------------------------------------------------------------------------
    def _kv_groups(self, ctx: LayerContext, mapping: Mapping) -> tuple[int, int] | None:
        """``(kv_heads, head_dim)`` when the previous op's outputs feed the linears through GQA head repetition."""
        previous = ctx.layer.get_submodule(mapping.previous)
        width = previous_width(ctx.layer, mapping, ctx.model_config)
        if not isinstance(previous, nn.Linear) or width == ctx.layer.get_submodule(mapping.linears[0]).in_features:
            return None
        config = ctx.model_config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return width // head_dim, head_dim

    def _expand(self, ctx: LayerContext, mapping: Mapping, scale: torch.Tensor) -> torch.Tensor:
        """Scale per previous-op output channel → per linear input channel (repeats KV heads under GQA)."""
        groups = self._kv_groups(ctx, mapping)
        if groups is None:
            return scale
        kv_heads, head_dim = groups
        in_features = ctx.layer.get_submodule(mapping.linears[0]).in_features
        repeat = in_features // (kv_heads * head_dim)
        return scale.view(kv_heads, 1, head_dim).expand(kv_heads, repeat, head_dim).reshape(-1)

    def _reduce(self, ctx: LayerContext, mapping: Mapping, per_input: torch.Tensor) -> torch.Tensor:
        """Inverse direction of :meth:`_expand` for statistics: average over the query heads sharing a KV head."""
        groups = self._kv_groups(ctx, mapping)
        if groups is None:
            return per_input
        kv_heads, head_dim = groups
        return per_input.view(kv_heads, -1, head_dim).mean(1).reshape(-1)

    @torch.no_grad()
    def _search_scale(self, ctx: LayerContext, mapping: Mapping, act: _Activations) -> torch.Tensor | None:
        """Best per-channel scale for the mapping, or None when no scaling beats leaving it alone."""
        scheme = self.config.scheme
        weight = torch.cat([ctx.layer.get_submodule(n).weight.data.float() for n in mapping.linears])
        group = scheme.group_for(weight.shape[1])
        grouped = weight.abs().view(weight.shape[0], -1, group)
        normalized = (grouped / (grouped.amax(-1, keepdim=True) + 1e-6)).view_as(weight)
        w_mean = self._reduce(ctx, mapping, normalized.mean(0))
        x_mean = self._reduce(ctx, mapping, act.mean_abs)

        def loss(per_input: torch.Tensor) -> float:
            quantized = fake_quantize(weight * per_input, scheme) / per_input
            return output_error(quantized - weight, act.gram).item()

        duo_modes = {True: (True,), False: (False,), "both": (True, False)}[self.config.duo_scaling]
        best_loss, best_scale = loss(torch.ones_like(act.mean_abs)), None
        for duo, step in itertools.product(duo_modes, range(self.config.grid)):
            exponent = step / self.config.grid
            scale = x_mean.pow(exponent)
            if duo:
                scale = scale / (w_mean.pow(1 - exponent) + 1e-4)
            scale = scale.clamp(min=1e-4)
            scale = scale / (scale.max() * scale.min()).sqrt()
            candidate = loss(self._expand(ctx, mapping, scale))
            if candidate < best_loss:
                best_loss, best_scale = candidate, scale
        if best_scale is not None and not torch.isfinite(best_scale).all():
            raise CompressError(f"{ctx.name}: AWQ found non-finite scales for {mapping.linears}; check activations")
        return best_scale

    def apply_scale(self, ctx: LayerContext, mapping: Mapping, scale: torch.Tensor) -> None:
        """Fold ``1/s`` into the previous op and ``s`` into the linears: the float model is unchanged."""
        per_input = self._expand(ctx, mapping, scale)
        fold_scale(ctx.layer, mapping, scale, per_input, ctx.model_config, self.norm_offset)

    # -- clipping search ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def _search_clip(self, weight: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
        """Per (output channel, group) range ratio minimising that group's share of the output error
        (the diagonal blocks of E[x xᵀ] give each group's error independently)."""
        scheme = self.config.scheme
        weight = weight.float()
        out_features, in_features = weight.shape
        group = scheme.group_for(in_features)
        groups = in_features // group
        blocks = gram.view(groups, group, groups, group).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # [G, g, g]
        best_error = torch.full((out_features, groups), float("inf"), device=weight.device)
        best_ratio = torch.ones(out_features, groups, device=weight.device)
        steps = max(1, round(self.config.max_shrink * self.config.clip_grid))
        for step in range(steps + 1):
            ratio = 1.0 - step / self.config.clip_grid
            delta = (fake_quantize(weight, scheme, ratio) - weight).view(out_features, groups, group).transpose(0, 1)
            error = (torch.bmm(delta, blocks) * delta).sum(-1).T  # [out, G]
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
        return best_ratio
