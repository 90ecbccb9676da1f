"""N:M semi-structured pruning (2:4 by default, 4:8): every run of M consecutive input weights of a row keeps N.

Three ways to choose which weights go, one class each, same lifecycle:
- ``magnitude``: drop the smallest |W|; no calibration. The baseline.
- ``wanda`` (Sun et al. 2023): drop the smallest |W_ij|·‖X_j‖₂, i.e. weight size times how loud its input channel
  is over the calibration tokens; no weight update.
- ``sparsegpt`` (Frantar & Alistarh 2023): walk the columns left to right; at the start of every M-column group
  drop the N:M weights whose removal costs least output error (w² / [H⁻¹]_jj²) and push each dropped or kept
  column's error into the columns not yet visited through the Cholesky factor of H⁻¹, H = E[x xᵀ] — the same
  statistic GPTQ uses, gathered and inverted by the same code (``compress.stages.hessian``), so pruning is followed
  by a weight update that compensates for what was removed.

Calibration is layer by layer like the quantizers (the pipeline feeds layer i+1 with the *pruned* outputs of layer
i) and, within a layer, sequential: o_proj's statistics are gathered after q/k/v are pruned, down_proj's after
gate/up. Linears reading the same input share one statistic and are pruned as one stacked matrix (rows are
independent). The kept mask is attached to each linear (``compress.grids.sparsity``); ``finalize`` checks that every
later stage kept it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from compress.base.errors import CompressError
from compress.formats.moe_experts import check_weights_handled
from compress.grids.int_grid import all_finite
from compress.grids.sparsity import NMPattern, attach_mask, check_masks_held, mask_of, nm_keep_mask
from compress.model.layer_walk import decoder_layers
from compress.stages.base import LayerContext, LayerWork, Stage
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
from compress.stages.weights import target_linears


@dataclass
class PruneConfig:
    sparsity: str = "2:4"  # N:M, N kept out of every M consecutive input weights
    # modules left as they are: an exact name, a dotted suffix (mlp.down_proj) or re:<regex>
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])

    def __post_init__(self):
        NMPattern.parse(self.sparsity)  # a bad pattern fails when the recipe is read

    @property
    def pattern(self) -> NMPattern:
        return NMPattern.parse(self.sparsity)


@dataclass
class CalibratedPruneConfig(PruneConfig):
    sequential: bool = True  # gather each input group's statistics after the groups before it are pruned


@dataclass
class SparseGPTConfig(CalibratedPruneConfig):
    block_size: int = 128  # columns updated lazily per block (a multiple of M)
    dampening: float = 0.01  # fraction of mean(diag H) added to the diagonal
    max_damp_retries: int = 6  # each failed Cholesky multiplies the dampening by 10

    def __post_init__(self):
        super().__post_init__()
        if self.block_size % self.pattern.m:
            raise ValueError(f"block_size={self.block_size} must be a multiple of M={self.pattern.m}")
        if not 0 < self.dampening <= 1:
            raise ValueError(f"dampening={self.dampening} must be in (0, 1]")


@torch.no_grad()
def sparsegpt_prune(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    pattern: NMPattern,
    block_size: int = 128,
    dampening: float = 0.01,
    retries: int = 6,
    name: str = "linear",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pruned weight, keep mask)`` for ``weight [out, in]`` against ``hessian [in, in]``."""
    W, H = without_dead_channels(weight, hessian)
    Hinv, _, _ = cholesky_inverse_upper(H, dampening, retries, name)
    Wt = W.t().contiguous()  # [in, out]: a column is one contiguous row
    keep = torch.ones_like(Wt, dtype=torch.bool)
    with one_thread():
        _sparsegpt_columns(Wt, Hinv, keep, pattern, block_size)
    return (Wt * keep).t().to(weight.dtype), keep.t()


def _sparsegpt_columns(
    Wt: torch.Tensor, Hinv: torch.Tensor, keep: torch.Tensor, pattern: NMPattern, block_size: int
) -> None:
    """The column walk, in place on the transposed weight ``Wt [in, out]`` and its ``keep`` mask, in four tensor ops
    per column (pruned part, ratio, rank-1 update of the block's later columns, zeroing)."""
    columns, m = Wt.shape[0], pattern.m
    for start in range(0, columns, block_size):
        end = min(start + block_size, columns)
        block, block_inv = Wt[start:end], Hinv[start:end, start:end]
        errors = torch.empty_like(block)
        pivots = block_inv.diagonal()
        ratios = pivots.tolist()
        for i in range(end - start):
            if i % m == 0:  # choose this group's survivors from the weights as compensated so far
                saliency = block[i : i + m].t().pow(2) / pivots[i : i + m].pow(2)
                keep[start + i : start + i + m] = nm_keep_mask(saliency, pattern).t()
                kept = keep[start + i : start + i + m].float()
                dropped = 1.0 - kept
            w, error = block[i], errors[i]
            torch.mul(w, dropped[i % m], out=error).div_(ratios[i])
            block[i + 1 :].addr_(block_inv[i, i + 1 :], error, alpha=-1)
            w.mul_(kept[i % m])
        Wt[end:].addmm_(Hinv[start:end, end:].t(), errors, alpha=-1)


class PruneStage(Stage):
    """Shared lifecycle: choose a keep mask per (stacked) linear, zero the rest, attach the mask, check it at the
    end. Subclasses implement :meth:`prune`."""

    Config = PruneConfig
    prunes_weights = True
    input_statistic: str | None = None  # "gram" (E[x xᵀ]) or "norm" (E[x²]); None: no calibration

    def prepare(self, model: nn.Module) -> None:
        pattern = self.config.pattern
        check_weights_handled(model, self.name)
        self.pruned: dict[str, float] = {}
        for index, layer in enumerate(decoder_layers(model)):
            for name, linear in target_linears(layer, f"model.layers.{index}", self.config.ignore).items():
                if mask_of(linear) is not None:
                    raise CompressError(f"model.layers.{index}.{name} is already pruned; keep one pruner per recipe")
                pattern.check(f"model.layers.{index}.{name}", linear.in_features)

    def prune(
        self, weight: torch.Tensor, statistic: torch.Tensor | None, name: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(new weight, keep mask)`` for one stacked weight ``[out, in]``."""
        raise NotImplementedError

    def process_layer(self, ctx: LayerContext) -> None:
        groups = input_groups(target_linears(ctx.layer, ctx.name, self.config.ignore))
        if self.input_statistic is None:
            for group in groups:
                self._prune_group(ctx, group, None)
            return
        if ctx.inputs is None:
            raise CompressError(f"{self.name} needs calibration inputs")
        diagonal = self.input_statistic == "norm"
        if self.config.sequential:  # each group's statistic after the groups before it are pruned
            for group, statistic in sequential_hessians(ctx, groups, diagonal):
                self._prune_group(ctx, group, statistic)
            return
        statistics = collect_hessians(ctx, [group[0] for group in groups], None, diagonal)  # one forward
        for group in groups:
            self._prune_group(ctx, group, statistics[group[0]])

    def _prune_group(self, ctx: LayerContext, names: list[str], statistic: torch.Tensor | None) -> None:
        linears = [ctx.layer.get_submodule(n) for n in names]
        full = f"{ctx.name}.{'+'.join(n.rpartition('.')[2] for n in names)}"
        weight = torch.cat([linear.weight.data for linear in linears])
        if not all_finite(weight):
            raise CompressError(f"{full}: weight holds NaN/inf; the model or an earlier stage is broken")
        new_weight, keep = self.prune(weight, statistic, full)
        row = 0
        for name, linear in zip(names, linears, strict=True):
            rows = slice(row, row + linear.out_features)
            row += linear.out_features
            linear.weight.data.copy_(new_weight[rows])
            attach_mask(linear, keep[rows], self.config.pattern)
            self.pruned[f"{ctx.name}.{name}"] = float((~keep[rows]).float().mean())

    def finalize(self, model: nn.Module) -> dict:
        achieved = check_masks_held(model)
        lost = sorted(set(self.pruned) - set(achieved))
        if lost:
            raise CompressError(f"{lost[0]} (and {len(lost) - 1} more) lost its sparsity mask in a later stage")
        per_layer = {name: achieved[name] for name in self.pruned}
        params = {
            name: model.get_submodule(name).in_features * model.get_submodule(name).out_features for name in per_layer
        }
        total = sum(params.values())
        return {
            "sparsity_structure": self.config.sparsity,
            "pruned_linears": len(per_layer),
            "mean_sparsity": sum(per_layer[n] * params[n] for n in per_layer) / max(total, 1),
            "per_layer_sparsity": per_layer,
        }


class MagnitudePruneStage(PruneStage):
    """N:M pruning by weight magnitude alone: drop the smallest |W|; no calibration."""

    name = "magnitude_prune"
    needs_calibration = False

    def prune(self, weight, statistic, name):
        keep = nm_keep_mask(weight.abs().float(), self.config.pattern)
        return weight * keep, keep


class WandaStage(PruneStage):
    """Wanda (Sun et al. 2023): drop the smallest |W| times its input channel's norm over the calibration tokens."""

    name = "wanda"
    Config = CalibratedPruneConfig
    input_statistic = "norm"

    def prune(self, weight, statistic, name):
        keep = nm_keep_mask(weight.abs().float() * statistic.sqrt()[None, :], self.config.pattern)
        return weight * keep, keep


class SparseGPTStage(PruneStage):
    """SparseGPT (Frantar and Alistarh 2023): prune column by column, updating the rest to absorb the error."""

    name = "sparsegpt"
    Config = SparseGPTConfig
    input_statistic = "gram"

    def working_bytes(self, work: LayerWork) -> float:
        return hessian_walk_bytes(work)

    def layer_seconds(self, work: LayerWork) -> float:
        """Its own forward and the Hessian walk (OBS updates column by column, as GPTQ's)."""
        return work.forward_seconds() + hessian_walk_seconds(work)

    def prune(self, weight, statistic, name):
        c = self.config
        return sparsegpt_prune(weight, statistic, c.pattern, c.block_size, c.dampening, c.max_damp_retries, name)
