"""The layer-input Hessian H = E[x xᵀ] that GPTQ and SparseGPT both solve against, gathered and inverted once here.

Both algorithms minimise ‖(W' - W) X‖² column by column and need the same three things: the second moment of a
linear's input over the calibration tokens, a dampened positive-definite copy of it, and the upper Cholesky factor
of its inverse. The papers write H = 2/n Σ x xᵀ; the factor 2 is dropped here because every use (the error
compensation ratios Hinv[i, j] / Hinv[i, i], the clipping search's argmin, the relative error) is invariant to the
scale of H, and dampening is relative to mean(diag H).

A Hessian belongs to an *input*, not to a linear: linears that read the same activations (q/k/v, gate/up) share
one, so :func:`input_groups` names one leader per input and :func:`collect_hessians` accumulates only what it is
asked for, in one forward over the calibration batches.
"""

from __future__ import annotations

import logging

import torch

from compress import distributed
from compress.calibration import observe_inputs
from compress.errors import CompressError
from compress.stages.base import LayerContext

log = logging.getLogger(__name__)

# Linears reading the same input, by name within their parent module, processed as one stacked matrix; the groups run
# in this order inside a decoder layer. Phi-3's fused qkv_proj / gate_up_proj take their unfused counterparts' places
# (a layer holds one form or the other); w1/w3/w2 are a Mixtral expert's gate/up/down. Each MoE expert (and shared
# expert) is its own parent: its gate/up share an input, other experts' do not (they see other tokens at run time).
SEQUENTIAL_GROUPS = (
    ("q_proj", "k_proj", "v_proj", "qkv_proj"),
    ("o_proj",),
    ("gate_proj", "up_proj", "gate_up_proj", "w1", "w3"),
    ("down_proj", "w2"),
)


def input_groups(targets: list[str] | dict) -> list[list[str]]:
    """``targets`` split into groups of siblings that share an input, in forward order (attention, output, every
    expert's gate/up, every expert's down); a linear no group names (a family with extra linears) is a group of its
    own, after the known ones. Each group's first name is its Hessian's key."""
    groups: dict[tuple[int, str], list[str]] = {}
    for name in targets:
        parent, _, leaf = name.rpartition(".")
        row = next((index for index, row in enumerate(SEQUENTIAL_GROUPS) if leaf in row), None)
        groups.setdefault((row, parent) if row is not None else (len(SEQUENTIAL_GROUPS), name), []).append(name)
    ordered = sorted(groups.items(), key=lambda item: item[0][0])  # stable: module order within a row
    return [sorted(names, key=_position(ordered_row)) for (ordered_row, _), names in ordered]


def _position(row: int):
    """Sort key putting a group's names in their ``SEQUENTIAL_GROUPS`` order (q, k, v; gate, up)."""
    names = SEQUENTIAL_GROUPS[row] if row < len(SEQUENTIAL_GROUPS) else ()
    return lambda name: names.index(name.rpartition(".")[2]) if names else 0


class HessianAccumulator:
    """Running Σ x xᵀ (or only its diagonal, Σ x², when ``diagonal``: Wanda's channel norms) over the tokens seen."""

    def __init__(self, diagonal: bool = False):
        self.diagonal = diagonal
        self.total: torch.Tensor | None = None
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        """One batch of inputs ``[tokens, in]`` (fp32)."""
        if self.total is None:
            shape = (x.shape[1],) if self.diagonal else (x.shape[1], x.shape[1])
            self.total = torch.zeros(shape, dtype=x.dtype, device=x.device)
        if self.diagonal:
            self.total += x.pow(2).sum(0)
        else:
            self.total.addmm_(x.T, x)  # in place: no second [in, in] temporary per batch
        self.tokens += x.shape[0]

    def all_reduce(self) -> None:
        """Sum the running totals over the data-parallel ranks (each saw its own shard of the tokens)."""
        distributed.all_reduce_sum(self.total)
        self.tokens = distributed.sum_count(self.tokens, self.total.device)

    def hessian(self) -> torch.Tensor:
        """E[x xᵀ] (or E[x²] per channel)."""
        return self.total / self.tokens


@torch.no_grad()
def collect_hessians(
    ctx: LayerContext, names: list[str], stop_at: str | None, diagonal: bool = False
) -> dict[str, torch.Tensor]:
    """Run the layer on its calibration inputs and return E[x xᵀ] (E[x²] when ``diagonal``) of each named linear's
    input; the forward stops at ``stop_at`` once that module's input has been seen (nothing after it is needed).
    Name one linear per shared input (a group leader from :func:`input_groups`): the others would be identical."""
    accumulators = {name: HessianAccumulator(diagonal) for name in names}
    observe_inputs(ctx.layer, ctx.inputs, ctx.name, {n: a.add for n, a in accumulators.items()}, stop_after=stop_at)
    for name, accumulator in accumulators.items():
        if accumulator.total is None:
            raise CompressError(
                f"{ctx.name}.{name}: no calibration token reached this linear's input (the forward stopped at "
                f"{stop_at} or never called it); gather its Hessian without stopping before it"
            )
        accumulator.all_reduce()
    return {name: accumulator.hessian() for name, accumulator in accumulators.items()}


def without_dead_channels(weight: torch.Tensor, hessian: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 working copies of ``weight [out, in]`` and ``hessian [in, in]``; inputs that never fire (zero diagonal)
    get a unit diagonal, keeping H invertible, and zero weights, since any value there is exact."""
    W = weight.detach().float().clone()
    H = hessian.detach().float().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    return W, H


def cholesky_inverse_upper(
    hessian: torch.Tensor, dampening: float, max_retries: int, name: str
) -> tuple[torch.Tensor, float, int]:
    """``(upper Cholesky factor of (H + λI)⁻¹, the dampening used, retries)`` with λ = dampening · mean(diag H);
    raises the dampening ×10 and retries when H is not positive definite (rank-deficient calibration data,
    duplicated channels, float round-off)."""
    mean_diag = hessian.diagonal().mean().item()
    identity = torch.eye(hessian.shape[0], dtype=hessian.dtype, device=hessian.device)
    damp = dampening
    for attempt in range(max_retries + 1):
        factor, info = torch.linalg.cholesky_ex(hessian + damp * mean_diag * identity)
        if info.item() == 0:
            inverse = torch.cholesky_inverse(factor)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if info.item() == 0 and torch.isfinite(upper).all():
                return upper, damp, attempt
        if attempt < max_retries:
            log.warning(
                "%s: Hessian not positive definite at dampening %.3g; retrying with %.3g", name, damp, damp * 10
            )
            damp *= 10
    raise CompressError(
        f"{name}: the Hessian stayed singular after {max_retries} dampening increases (last {damp:.3g}); "
        "use more or more varied calibration samples, or raise `dampening`/`max_damp_retries`"
    )
