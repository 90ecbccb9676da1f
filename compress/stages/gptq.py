"""GPTQ (Frantar et al. 2022): quantize a linear's weight column by column, compensating each column's rounding
error in the columns not yet quantized, using the inverse of the input's second moment H = E[x xᵀ].

What this implementation adds around the published algorithm:
- dampening starts at ``dampening`` × mean(diag H) and is multiplied by 10 (logged) whenever the Cholesky
  factorization fails, instead of aborting the run on a rank-deficient Hessian;
- the linears that read the same input (q/k/v, gate/up) share one Hessian and are quantized as one stacked matrix
  (rows are independent in GPTQ, so this is exact and 3× fewer column steps);
- "true sequential" inside a decoder layer: o_proj's Hessian is gathered after q/k/v are quantized, down_proj's after
  gate/up, so every linear compensates the errors of the ones before it (the pipeline already feeds layer i+1 with
  the quantized outputs of layer i);
- per-group clipping chosen to minimise the Hessian-weighted error of the group before GPTQ runs (an MSE observer
  weighted by what the layer actually sees);
- activation order with *static* groups: columns are visited by decreasing Hessian diagonal, but each group's scale
  is fixed up front from the original weight, so the stored layer needs no permutation (no ``g_idx``) at inference.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from compress.base import distributed
from compress.base.errors import CompressError
from compress.base.memory import release_freed_memory
from compress.formats import QuantizedLinear
from compress.grids.int_grid import WeightScheme, all_finite
from compress.kernels.dequant import dequantize_codes
from compress.model.layer_walk import FullPrecisionStream
from compress.stages.base import LayerContext, LayerWork
from compress.stages.cross_moments import CrossMoments
from compress.stages.fp4_weights import Fp4Grid
from compress.stages.hessian import (
    cholesky_inverse_upper,
    collect_hessians,
    hessian_walk_bytes,
    hessian_walk_seconds,
    input_groups,
    one_thread,
    sequential_hessians,
    without_dead_channels,
)
from compress.stages.weights import WeightQuantConfig, WeightQuantizerStage, replace_module, target_linears

CLIP_RATIOS = tuple(1.0 - step / 20 for step in range(8))  # 1.0 ... 0.65


@dataclass
class GPTQConfig(WeightQuantConfig):
    block_size: int = 128  # columns updated lazily per block; the rest get one matrix update per block
    dampening: float = 0.01  # fraction of mean(diag H) added to the diagonal
    max_damp_retries: int = 6  # each failed Cholesky multiplies the dampening by 10
    act_order: bool = False  # static-group activation order; gptq_int4/int3 and rotate_gptq_* set it (measured better)
    clip_search: bool = True  # try shrunken ranges per group and keep the one with the least Hessian-weighted error
    true_sequential: bool = True  # gather o_proj's and down_proj's inputs after the linears before them are quantized
    input_correction: bool = False  # GPTAQ: also absorb the input error of the compressed layers before (cross_moments)

    def __post_init__(self):
        if not 0 < self.dampening <= 1:
            raise ValueError(f"dampening={self.dampening} must be in (0, 1]")
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be positive")
        if self.input_correction and not self.true_sequential:
            raise ValueError("input_correction=true needs true_sequential=true (it follows each group's inputs)")


@dataclass
class GPTQResult:
    codes: torch.Tensor  # int8 [out, in], original column order
    scale: torch.Tensor  # [out, groups]
    zero_point: torch.Tensor | None
    dampening: float  # the dampening that made H positive definite
    retries: int
    hessian_error: float  # tr(Δ H Δᵀ) / tr(W H Wᵀ): relative output error on the calibration inputs
    positions: torch.Tensor | None = None  # [out, in] fp32: each compensated weight / its scale, before rounding


def _group_params(
    columns: torch.Tensor, hessian_block: torch.Tensor, scheme: WeightScheme, clip_search: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point) per row ``[out, 1]`` for one group of ``columns`` (``[group, out]``, the transposed
    weight's rows); with ``clip_search`` the range ratio per row that minimises the group's Hessian-weighted rounding
    error. Every ratio is tried at once along a middle axis, with :func:`compress.grids.int_grid.quantize`'s arithmetic
    (the
    stored scales are the ones it would give), and scored by one matmul; ties keep the earlier, wider range."""
    group, rows = columns.shape
    ratios = torch.tensor(CLIP_RATIOS if clip_search else (1.0,), device=columns.device)[:, None]
    weight = columns[:, None, :]  # [group, 1, out]
    levels = (1 << scheme.bits) - 1
    if scheme.symmetric:
        scale = columns.abs().amax(0) * ratios / (levels / 2)
    else:
        high = columns.amax(0).clamp(min=0) * ratios
        low = columns.amin(0).clamp(max=0) * ratios
        scale = (high - low) / levels
    scale = scale.clamp(min=torch.finfo(torch.float16).tiny).to(dtype).float()  # [ratios, out]
    codes = torch.round(weight / scale)
    zero = None
    if not scheme.symmetric:
        zero = (scheme.qmin - torch.round(low / scale)).clamp(scheme.qmin, scheme.qmax)
        codes = codes.add_(zero).clamp_(scheme.qmin, scheme.qmax).sub_(zero)
    else:
        codes.clamp_(scheme.qmin, scheme.qmax)
    delta = codes.mul_(scale).sub_(weight).reshape(group, -1)  # [group, ratios * out]
    error = ((hessian_block @ delta) * delta).sum(0).view(len(ratios), rows)
    best = error.argmin(0), torch.arange(rows, device=columns.device)
    return scale[best][:, None].to(dtype), None if zero is None else zero[best][:, None].to(torch.int8)


class _GroupGrid:
    """Per group of columns: the stored scale (and zero point) and, for the column walk, the fp32 scale and the
    code range shifted by the zero point (``round(w / s)`` clamped to ``[qmin - z, qmax - z]`` is ``q - z``)."""

    def __init__(self, groups: int, out_features: int, scheme: WeightScheme, dtype: torch.dtype, device):
        self.scheme = scheme
        self.scales = torch.empty(groups, out_features, dtype=dtype, device=device)
        self.zeros = None if scheme.symmetric else torch.empty(groups, out_features, dtype=torch.int8, device=device)
        self.float_scales = torch.empty(groups, out_features, device=device)
        self.low = torch.full((groups, out_features), float(scheme.qmin), device=device)
        self.high = torch.full((groups, out_features), float(scheme.qmax), device=device)

    def set(self, g: int, scale: torch.Tensor, zero: torch.Tensor | None) -> None:
        self.scales[g] = scale[:, 0]
        self.float_scales[g] = self.scales[g].float()
        if self.zeros is not None:
            self.zeros[g] = zero[:, 0]
            self.low[g] -= self.zeros[g].float()
            self.high[g] -= self.zeros[g].float()


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scheme: WeightScheme,
    *,
    block_size: int = 128,
    dampening: float = 0.01,
    max_damp_retries: int = 6,
    act_order: bool = False,
    clip_search: bool = True,
    scale_dtype: torch.dtype | None = None,
    name: str = "linear",
    grid: Fp4Grid | None = None,
    keep_positions: bool = False,
) -> GPTQResult:
    """Quantize ``weight [out, in]`` against ``hessian [in, in]`` (E[x xᵀ] of its inputs). With an FP4 ``grid``
    the columns are rounded onto e2m1 times each group's scale (codes 0..15, ``scale`` the fp32 effective scales).

    The column walk runs on the transposed weight, where a column is one contiguous row, in six tensor ops per
    column (divide, round, clamp, residual, ratio, rank-1 update of the block's later columns) on one thread; the
    columns after the block get one matrix update per block (lazy batch updates). ``keep_positions`` also returns
    where each compensated weight fell on the grid before rounding, in units of its scale (a starting point for a
    rounding optimizer: how close each weight came to rounding the other way)."""
    if grid is not None and act_order:
        raise CompressError(f"{name}: act_order is not supported with FP4 formats; set act_order=false")
    dtype = torch.float32 if grid is not None else scale_dtype or weight.dtype
    W, H = without_dead_channels(weight, hessian)
    out_features, columns = W.shape
    group = scheme.group_for(columns)
    params = _GroupGrid(columns // group, out_features, scheme, dtype, W.device)
    order = torch.arange(columns, device=W.device)
    if act_order:  # static groups: parameters fixed from the original weight before any compensation
        for g in range(columns // group):
            cols = slice(g * group, (g + 1) * group)
            params.set(g, *_group_params(W[:, cols].t(), H[cols, cols], scheme, clip_search, dtype))
        order = torch.argsort(H.diagonal(), descending=True)
        W, H = W[:, order], H[order][:, order]
    group_of = (order // group).tolist()  # read once: one .item() per column would sync the GPU thousands of times
    Hinv, damp, retries = cholesky_inverse_upper(H, dampening, max_damp_retries, name)

    Wt = W.t().contiguous()  # [in, out], compensated in place block by block
    del W
    centered = torch.empty_like(Wt)  # q - z of every column (FP4: its e2m1 code), in visiting order
    positions = torch.empty_like(Wt) if keep_positions else None  # w / s before rounding (FP4: e2m1 units)
    with one_thread():
        for start in range(0, columns, block_size):
            end = min(start + block_size, columns)
            block, block_inv = Wt[start:end], Hinv[start:end, start:end]
            errors = torch.empty_like(block)
            pivots = block_inv.diagonal().tolist()
            for i in range(end - start):
                column, g = start + i, group_of[start + i]
                if not act_order and column % group == 0:  # lazy groups: from the weight as compensated so far
                    cols = slice(column, column + group)
                    pending = Wt[cols]
                    if grid is not None:
                        params.set(g, grid.group_scales(pending.t().contiguous(), H[cols, cols]), None)
                    else:
                        params.set(g, *_group_params(pending, H[cols, cols], scheme, clip_search, dtype))
                scale, w, q, error = params.float_scales[g], block[i], centered[column], errors[i]
                if grid is not None:
                    if positions is not None:
                        torch.div(w, scale, out=positions[column])
                    code, value = grid.round(w, scale)
                    q.copy_(code)
                    torch.sub(w, value, out=error).div_(pivots[i])
                else:
                    torch.div(w, scale, out=q)
                    if positions is not None:
                        positions[column].copy_(q)
                    q.round_()
                    torch.clamp(q, params.low[g], params.high[g], out=q)
                    torch.addcmul(w, q, scale, value=-1, out=error).div_(pivots[i])
                block[i + 1 :].addr_(block_inv[i, i + 1 :], error, alpha=-1)
            Wt[end:].addmm_(Hinv[start:end, end:].t(), errors, alpha=-1)

    del Wt, Hinv, H  # the working copies, before the error's own temporaries
    if params.zeros is not None:
        centered += params.zeros.float()[group_of]
    codes = torch.empty(out_features, columns, dtype=torch.int8, device=centered.device)
    codes[:, order] = centered.t().to(torch.int8)
    del centered
    if positions is not None:
        unpermuted = torch.empty(out_features, columns, device=positions.device)
        unpermuted[:, order] = positions.t()
        positions = unpermuted
    scales = params.scales.t().contiguous()
    zeros = None if params.zeros is None else params.zeros.t().contiguous()

    def dequantized(rows: slice) -> torch.Tensor:
        if grid is not None:
            return grid.dequantize(codes[rows], scales[rows])
        return dequantize_codes(codes[rows], scales[rows].float(), None if zeros is None else zeros[rows], group)

    error = hessian_relative_error(weight, hessian, dequantized)
    return GPTQResult(codes, scales, zeros, damp, retries, error, positions)


ERROR_ROWS = 1024  # rows of the weight whose dequantized copy and error exist at once in hessian_relative_error


def hessian_relative_error(
    weight: torch.Tensor, hessian: torch.Tensor, dequantized: Callable[[slice], torch.Tensor]
) -> float:
    """tr(ΔHΔᵀ) / tr(WHWᵀ) with Δ = ``dequantized(rows)`` − ``weight[rows]``, ``ERROR_ROWS`` rows at a time: computed
    whole, its temporaries were four fp32 copies of the weight (800 MB for a 4B model's stacked gate/up), the
    largest block of a layer's GPTQ memory."""
    reference_h = hessian.detach().float()
    error = total = 0.0
    for start in range(0, weight.shape[0], ERROR_ROWS):
        rows = slice(start, start + ERROR_ROWS)
        original = weight[rows].detach().float()
        delta = dequantized(rows) - original
        error += float(((delta @ reference_h) * delta).sum())
        total += float(((original @ reference_h) * original).sum())
    return error / max(total, 1e-30)


def quantize_rows_across_ranks(weight: torch.Tensor, hessian: torch.Tensor, *args, **kwargs) -> GPTQResult:
    """:func:`gptq_quantize` with the rows of ``weight`` split across the data-parallel ranks and gathered back on
    every rank: GPTQ's rows are independent given H (the Hessian, the dampening and the Cholesky factor are the
    same for every row), so each rank solves its own rows. One process: ``gptq_quantize`` itself."""
    if not distributed.active():
        return gptq_quantize(weight, hessian, *args, **kwargs)
    rows = distributed.row_range(weight.shape[0])
    part = gptq_quantize(weight[rows], hessian, *args, **kwargs)
    # the relative error tr(ΔHΔᵀ)/tr(WHWᵀ) of the whole matrix, from each rank's share of both traces
    mine = weight[rows].float()
    totals = torch.zeros(2, dtype=torch.float64, device=weight.device)
    totals[1] = ((mine @ hessian.float()) * mine).sum()
    totals[0] = part.hessian_error * totals[1]
    distributed.all_reduce_sum(totals)
    out_features = weight.shape[0]
    zero = None if part.zero_point is None else distributed.gather_rows(part.zero_point, out_features)
    return GPTQResult(
        codes=distributed.gather_rows(part.codes, out_features),
        scale=distributed.gather_rows(part.scale, out_features),
        zero_point=zero,
        dampening=part.dampening,
        retries=part.retries,
        hessian_error=float(totals[0] / totals[1].clamp(min=1e-30)),
        positions=None if part.positions is None else distributed.gather_rows(part.positions, out_features),
    )


class GPTQStage(WeightQuantizerStage):
    name = "gptq"
    Config = GPTQConfig
    formats = ("int", "nvfp4", "mxfp4")

    def algorithm(self) -> str:
        return f"{self.gptq_options()}, {self.config.scheme.describe()}"

    def gptq_options(self) -> str:
        c = self.config
        options = [name for name, on in (("true-sequential", c.true_sequential), ("act-order", c.act_order)) if on]
        options += ["Hessian-weighted clipping search"] if c.clip_search else []
        options += ["input correction (GPTAQ)"] if c.input_correction else []
        return f"GPTQ ({', '.join(options) or 'plain'})"

    def working_bytes(self, work: LayerWork) -> float:
        return hessian_walk_bytes(work)

    def layer_seconds(self, work: LayerWork) -> float:
        """Its own forward (the layer's outputs for the next) and the Hessian walk."""
        return work.forward_seconds() + hessian_walk_seconds(work)

    keep_positions = False  # set by a rounding optimizer that starts from GPTQ's solution (signround init=gptq)

    def prepare(self, model: nn.Module) -> None:
        super().prepare(model)
        self.retries: dict[str, int] = {}
        self.positions: dict[str, torch.Tensor] = {}  # per linear, when keep_positions: see gptq_quantize
        self.full_precision = FullPrecisionStream() if self.config.input_correction else None

    def process_layer(self, ctx: LayerContext) -> None:
        if ctx.inputs is None:
            raise CompressError("GPTQ needs calibration inputs")
        targets = target_linears(ctx.layer, ctx.name, self.config.ignore)
        if self.fp4 is not None:
            self.fp4.observe(ctx, targets)  # W4A4 input scales, from the layer before any of it is quantized
        groups = input_groups(targets)
        if self.full_precision is not None:
            inputs, _ = self.full_precision.advance(ctx.layer, ctx.inputs, ctx.index, ctx.name)
            cross = CrossMoments(copy.deepcopy(ctx.layer), inputs, ctx.name)
            for group, hessian in sequential_hessians(ctx, groups, observer=cross.add):
                self._quantize_group(ctx, group, hessian, target=cross.corrected_weight)
            return
        if self.config.true_sequential:  # each group's Hessian after the groups before it are quantized
            for group, hessian in sequential_hessians(ctx, groups):
                self._quantize_group(ctx, group, hessian)
            return
        hessians = collect_hessians(ctx, [group[0] for group in groups], stop_at=None)  # one forward
        for group in groups:
            self._quantize_group(ctx, group, hessians[group[0]])

    def _quantize_group(
        self,
        ctx: LayerContext,
        names: list[str],
        hessian: torch.Tensor,
        scheme: WeightScheme | None = None,
        target: Callable[[str, torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None,
    ) -> None:
        """GPTQ on the stacked weights of ``names`` (one shared input) with ``scheme`` (default the stage's);
        ``target(leader, weight, hessian, dampening)`` replaces the weight GPTQ aims at (input correction)."""
        release_freed_memory()
        scheme = scheme or self.config.scheme
        linears = [ctx.layer.get_submodule(n) for n in names]
        full = f"{ctx.name}.{'+'.join(n.rpartition('.')[2] for n in names)}"
        weight = torch.cat([linear.weight.data for linear in linears])
        if not all_finite(weight):
            raise CompressError(f"{full}: weight holds NaN/inf; the model or an earlier stage is broken")
        c = self.config
        if target is not None:
            weight = target(names[0], weight, hessian, c.dampening)
        result = quantize_rows_across_ranks(
            weight,
            hessian,
            scheme,
            block_size=c.block_size,
            dampening=c.dampening,
            max_damp_retries=c.max_damp_retries,
            act_order=c.act_order,
            clip_search=c.clip_search,
            scale_dtype=ctx.dtype,
            name=full,
            grid=self._fp4_grid(weight, ctx.dtype),
            keep_positions=self.keep_positions,
        )
        if result.retries:
            self.retries[full] = result.retries
        row = 0
        for name, linear in zip(names, linears, strict=True):
            rows = slice(row, row + linear.out_features)
            row += linear.out_features
            zero = None if result.zero_point is None else result.zero_point[rows]
            if result.positions is not None:
                self.positions[name] = result.positions[rows]
            module = self.build_module(linear, result.codes[rows], result.scale[rows], zero, scheme)
            dense = linear.weight.data.float()
            error = (module.dequantized_weight().float() - dense).pow(2).mean() / dense.pow(2).mean()
            self.stats[f"{ctx.name}.{name}"] = {
                "weight_rel_mse": float(error),
                "hessian_rel_error": result.hessian_error,
                "dampening": result.dampening,
            }
            replace_module(ctx.layer, name, module.to(linear.weight.device))

    def _fp4_grid(self, weight: torch.Tensor, dtype: torch.dtype) -> Fp4Grid | None:
        """FP4 formats: the grid GPTQ rounds onto (NVFP4's global scale from the stacked weight in the model's
        dtype, as RTN takes it), kept for :meth:`build_module`; None for integer schemes."""
        self.grid = (
            None if self.fp4 is None else Fp4Grid.for_weight(weight.to(dtype), self.fp4.fmt, self.config.clip_search)
        )
        return self.grid

    def build_module(
        self,
        linear: nn.Linear,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor | None,
        scheme: WeightScheme,
    ) -> nn.Module:
        """The stored form of one quantized linear (packed int-N or FP4 here; W8A8 overrides it)."""
        if self.fp4 is not None:
            return self.fp4.module(linear, codes, scale, self.grid.global_scale)
        bias = None if linear.bias is None else linear.bias.data
        return QuantizedLinear.from_codes(codes, scale, zero, scheme.bits, scheme.group_for(linear.in_features), bias)

    def finalize(self, model: nn.Module) -> dict:
        summary = super().finalize(model)
        errors = [s["hessian_rel_error"] for s in self.stats.values()]
        summary.update(mean_hessian_rel_error=sum(errors) / max(len(errors), 1), cholesky_retries=self.retries)
        return summary
