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

from dataclasses import dataclass

import torch
from torch import nn

from compress import distributed
from compress.errors import CompressError
from compress.qlinear import QuantizedLinear
from compress.quant import WeightScheme, quantize
from compress.stages.base import LayerContext
from compress.stages.fp4 import Fp4Grid
from compress.stages.hessian import cholesky_inverse_upper, collect_hessians, input_groups, without_dead_channels
from compress.stages.weights import WeightQuantConfig, WeightQuantizerStage, replace_module, target_linears
from kernels.dequant import dequantize_codes

CLIP_RATIOS = tuple(1.0 - step / 20 for step in range(8))  # 1.0 ... 0.65


@dataclass
class GPTQConfig(WeightQuantConfig):
    block_size: int = 128  # columns updated lazily per block; the rest get one matrix update per block
    dampening: float = 0.01  # fraction of mean(diag H) added to the diagonal
    max_damp_retries: int = 6  # each failed Cholesky multiplies the dampening by 10
    act_order: bool = False  # static-group activation order; measured no better than lazy groups + clipping
    clip_search: bool = True
    true_sequential: bool = True

    def __post_init__(self):
        if not 0 < self.dampening <= 1:
            raise ValueError(f"dampening={self.dampening} must be in (0, 1]")
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be positive")


@dataclass
class GPTQResult:
    codes: torch.Tensor  # int8 [out, in], original column order
    scale: torch.Tensor  # [out, groups]
    zero_point: torch.Tensor | None
    dampening: float  # the dampening that made H positive definite
    retries: int
    hessian_error: float  # tr(Δ H Δᵀ) / tr(W H Wᵀ): relative output error on the calibration inputs


def _group_params(
    weight: torch.Tensor, hessian_block: torch.Tensor, scheme: WeightScheme, clip_search: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point) per row for one group of columns; with ``clip_search`` the range ratio per row that
    minimises the group's Hessian-weighted rounding error."""
    channel = WeightScheme(scheme.bits, None, scheme.symmetric)
    best = None
    for ratio in CLIP_RATIOS if clip_search else (1.0,):
        codes, scale, zero = quantize(weight, channel, ratio, scale_dtype=dtype)
        delta = dequantize_codes(codes, scale.float(), zero, weight.shape[1]) - weight
        error = ((delta @ hessian_block) * delta).sum(1)
        if best is None:
            best = [error, scale, zero]
            continue
        better = error < best[0]
        best[0] = torch.where(better, error, best[0])
        best[1] = torch.where(better[:, None], scale, best[1])
        if zero is not None:
            best[2] = torch.where(better[:, None], zero, best[2])
    return best[1], best[2]


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
) -> GPTQResult:
    """Quantize ``weight [out, in]`` against ``hessian [in, in]`` (E[x xᵀ] of its inputs). With an FP4 ``grid``
    the columns are rounded onto e2m1 times each group's scale (codes 0..15, ``scale`` the fp32 effective scales)."""
    if grid is not None and act_order:
        raise CompressError(f"{name}: act_order is not supported with FP4 formats; set act_order=false")
    dtype = torch.float32 if grid is not None else scale_dtype or weight.dtype
    original, reference_h = weight.detach().float().clone(), hessian.detach().float()
    W, H = without_dead_channels(weight, hessian)
    out_features, columns = W.shape
    group = scheme.group_for(columns)
    qmin, qmax = scheme.qmin, scheme.qmax

    groups = columns // group
    scales = torch.empty(out_features, groups, dtype=dtype, device=W.device)
    zeros = None if scheme.symmetric else torch.empty(out_features, groups, dtype=torch.int8, device=W.device)
    if act_order:  # static groups: parameters fixed from the original weight before any compensation
        for g in range(groups):
            cols = slice(g * group, (g + 1) * group)
            scale, zero = _group_params(W[:, cols], H[cols, cols], scheme, clip_search, dtype)
            scales[:, g : g + 1] = scale
            if zeros is not None:
                zeros[:, g : g + 1] = zero
        order = torch.argsort(H.diagonal(), descending=True)
    else:
        order = torch.arange(columns, device=W.device)
    W, H = W[:, order], H[order][:, order]
    column_order = order.tolist()  # read once: one .item() per column would sync the GPU thousands of times
    Hinv, damp, retries = cholesky_inverse_upper(H, dampening, max_damp_retries, name)

    codes = torch.empty(out_features, columns, dtype=torch.int8, device=W.device)
    for start in range(0, columns, block_size):
        end = min(start + block_size, columns)
        block = W[:, start:end].clone()
        errors = torch.empty_like(block)
        block_inv = Hinv[start:end, start:end]
        for i in range(end - start):
            column = column_order[start + i]
            g = column // group
            if not act_order and column % group == 0:  # lazy groups: from the weight as compensated so far
                cols = slice(start + i, start + i + group)
                pending = _pending(W, block, start, i, group)
                if grid is not None:
                    scale, zero = grid.group_scales(pending, H[cols, cols]), None
                else:
                    scale, zero = _group_params(pending, H[cols, cols], scheme, clip_search, dtype)
                scales[:, g : g + 1] = scale
                if zeros is not None:
                    zeros[:, g : g + 1] = zero
            scale = scales[:, g].float()
            zero = 0.0 if zeros is None else zeros[:, g].float()
            w = block[:, i]
            if grid is not None:
                q, rounded = grid.round(w, scale)
            else:
                q = (torch.round(w / scale) + zero).clamp_(qmin, qmax)
                rounded = (q - zero) * scale
            codes[:, column] = q.to(torch.int8)
            error = (w - rounded) / block_inv[i, i]
            block[:, i:] -= error[:, None] * block_inv[i, i:][None, :]
            errors[:, i] = error
        W[:, end:] -= errors @ Hinv[start:end, end:]

    dequantized = (
        grid.dequantize(codes, scales) if grid is not None else dequantize_codes(codes, scales.float(), zeros, group)
    )
    delta = dequantized - original
    hessian_error = ((delta @ reference_h) * delta).sum() / ((original @ reference_h) * original).sum().clamp(min=1e-30)
    return GPTQResult(codes, scales, zeros, damp, retries, float(hessian_error))


def _pending(W: torch.Tensor, block: torch.Tensor, start: int, i: int, group: int) -> torch.Tensor:
    """Columns ``start+i ... start+i+group`` as compensated so far: the in-block part lives in ``block``."""
    inside = block[:, i : i + group]
    rest = group - inside.shape[1]
    return inside if rest == 0 else torch.cat([inside, W[:, start + block.shape[1] : start + block.shape[1] + rest]], 1)


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
    )


class GPTQStage(WeightQuantizerStage):
    name = "gptq"
    Config = GPTQConfig
    formats = ("int", "nvfp4", "mxfp4")

    def prepare(self, model: nn.Module) -> None:
        super().prepare(model)
        self.retries: dict[str, int] = {}

    def process_layer(self, ctx: LayerContext) -> None:
        if ctx.inputs is None:
            raise CompressError("GPTQ needs calibration inputs")
        targets = target_linears(ctx.layer, ctx.name, self.config.ignore)
        if self.fp4 is not None:
            self.fp4.observe(ctx, targets)  # W4A4 input scales, from the layer before any of it is quantized
        groups = input_groups(targets)
        if not self.config.true_sequential:  # one forward, one Hessian per shared input
            hessians = collect_hessians(ctx, [group[0] for group in groups], stop_at=None)
        for group in groups:
            if self.config.true_sequential:
                hessians = collect_hessians(ctx, [group[0]], stop_at=group[0])
            self._quantize_group(ctx, group, hessians[group[0]])

    def _quantize_group(
        self, ctx: LayerContext, names: list[str], hessian: torch.Tensor, scheme: WeightScheme | None = None
    ) -> None:
        """GPTQ on the stacked weights of ``names`` (one shared input) with ``scheme`` (default the stage's)."""
        scheme = scheme or self.config.scheme
        linears = [ctx.layer.get_submodule(n) for n in names]
        full = f"{ctx.name}.{'+'.join(n.rpartition('.')[2] for n in names)}"
        weight = torch.cat([linear.weight.data for linear in linears])
        if not torch.isfinite(weight).all():
            raise CompressError(f"{full}: weight holds NaN/inf; the model or an earlier stage is broken")
        c = self.config
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
        )
        if result.retries:
            self.retries[full] = result.retries
        row = 0
        for name, linear in zip(names, linears, strict=True):
            rows = slice(row, row + linear.out_features)
            row += linear.out_features
            zero = None if result.zero_point is None else result.zero_point[rows]
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
