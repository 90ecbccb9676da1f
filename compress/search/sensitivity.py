"""Step 1: each linear's predicted loss under each candidate scheme, ½ Σ_o f_o · ΔW_o H ΔW_oᵀ (Fisher-weighted output
error), measured in one layer walk, with the linears that must share a scheme grouped into units."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from compress.base.errors import CompressError
from compress.compression.in_memory import compress_model
from compress.formats import Fp8Linear
from compress.formats.moe_experts import unfuse_experts
from compress.grids.int_grid import fake_quantize
from compress.model.lazy_weights import materialize_all
from compress.search.spec import DEFAULT_CANDIDATES
from compress.stages.base import LayerContext, Stage
from compress.stages.hessian import collect_hessians, input_groups
from compress.stages.mixed import Candidate, candidate
from compress.stages.weights import target_linears

EXPERTS = re.compile(r"\.experts\.\d+\..*$")  # a linear of one expert: its layer's experts form one unit


@dataclass
class Unit:
    """Linears that must share a scheme: one choice of the allocation."""

    names: list[str]  # full module names
    params: int
    bits: dict[str, int]  # scheme → stored bits of all its linears
    cost: dict[str, float]  # scheme → predicted error (summed output error on the calibration tokens)


def quantization_delta(linear: nn.Linear, chosen: Candidate) -> torch.Tensor:
    """The weight error ``Q(W) - W`` of ``chosen`` (fp32)."""
    weight = linear.weight.detach().float()
    if chosen.kind == "dense":
        return torch.zeros_like(weight)
    if chosen.kind == "fp8":
        return Fp8Linear.from_float(linear).dequantized_weight().float() - weight
    return fake_quantize(weight, chosen.weight_scheme) - weight


def fits(chosen: Candidate, in_features: int) -> bool:
    return chosen.kind != "int" or chosen.group_size is None or in_features % chosen.group_size == 0


@torch.enable_grad()
def output_fisher(
    model: nn.Module, samples: torch.Tensor, device: torch.device, batch_size: int
) -> dict[str, torch.Tensor]:
    """Per linear (full name): the mean over calibration tokens of the squared gradient of the summed next-token
    loss with respect to each of its outputs, [out_features] fp32 on the CPU. Weights get no gradient; the model
    goes to ``device`` for the pass and comes back."""
    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    totals: dict[str, torch.Tensor] = {}

    def keep_gradient(name: str):
        def hook(module, args, output):
            def accumulate(gradient: torch.Tensor) -> None:
                squares = gradient.detach().float().pow(2).flatten(0, -2).sum(0).cpu()
                totals[name] = totals[name] + squares if name in totals else squares

            output.register_hook(accumulate)

        return hook

    materialize_all(model)  # a lazily loaded model's layers come off the meta device before it moves
    handles = [module.register_forward_hook(keep_gradient(name)) for name, module in linears.items()]
    flags = [parameter.requires_grad for parameter in model.parameters()]
    home = next(model.parameters()).device
    model.requires_grad_(False).to(device)
    embed = model.get_input_embeddings()
    tokens = 0
    try:
        for start in range(0, len(samples), batch_size):
            ids = samples[start : start + batch_size].to(device)
            embeddings = embed(ids).detach().requires_grad_()  # the graph starts here; weights stay leaves
            logits = model(inputs_embeds=embeddings, use_cache=False).logits[:, :-1]
            loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")
            loss.backward()
            tokens += ids.numel()
    finally:
        for handle in handles:
            handle.remove()
        for parameter, flag in zip(model.parameters(), flags, strict=True):
            parameter.requires_grad_(flag)
        model.to(home)
    return {name: total / tokens for name, total in totals.items()}


@dataclass
class SensitivityConfig:
    candidates: list[str] = field(default_factory=lambda: list(DEFAULT_CANDIDATES))
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])


class SensitivityStage(Stage):
    """Measures, changes nothing: each unit's error and size under every candidate, in one walk over the dense
    model (not a recipe stage: ``compress search`` runs it through ``compress_model`` for the walk)."""

    name = "sensitivity"
    Config = SensitivityConfig

    def __init__(self, config: SensitivityConfig, fisher: dict[str, torch.Tensor] | None = None):
        super().__init__(config)
        self.fisher = fisher  # from output_fisher; None: every output counts alike

    def _output_weight(self, name: str, siblings: list[str], out_features: int) -> torch.Tensor:
        """What one unit of squared error on each output of linear ``name`` costs: ½ f (the loss, to second order),
        or 1 without Fisher weights (the plain output error). A linear no gradient reached (an expert the router
        never picked) gets the mean f of its layer's others, so an idle expert is neither free to crush nor precious."""
        if self.fisher is None:
            return torch.ones(out_features)
        if name in self.fisher:
            return 0.5 * self.fisher[name]
        reached = [self.fisher[other].mean() for other in siblings if other in self.fisher]
        return torch.full((out_features,), 0.5 * float(torch.stack(reached).mean()) if reached else 0.0)

    def prepare(self, model: nn.Module) -> None:
        self.candidates = [candidate(name) for name in self.config.candidates]
        self.units: list[Unit] = []

    @torch.no_grad()
    def process_layer(self, ctx: LayerContext) -> None:
        if ctx.inputs is None:
            raise CompressError("sensitivity needs calibration inputs")
        targets = target_linears(ctx.layer, ctx.name, self.config.ignore)
        groups = input_groups(targets)
        hessians = collect_hessians(ctx, [group[0] for group in groups], stop_at=None)  # experts: from all tokens
        dtype_bits = torch.finfo(ctx.dtype).bits
        siblings = [f"{ctx.name}.{name}" for name in targets]
        units: dict[str, Unit] = {}  # one per input group, but one for all of a layer's experts (see _merged)
        for group in groups:
            linears = [targets[name] for name in group]
            hessian = hessians[group[0]]
            weights = [
                self._output_weight(f"{ctx.name}.{name}", siblings, linear.out_features)
                for name, linear in zip(group, linears, strict=True)
            ]
            options = [c for c in self.candidates if all(fits(c, linear.in_features) for linear in linears)]
            if not options:
                raise CompressError(
                    f"{ctx.name}.{group[0]}: no candidate fits its input width {linears[0].in_features}; "
                    "add a per-channel scheme (int8) or bf16 to search.candidates"
                )
            cost, bits = {}, {}
            for chosen in options:
                deltas = [quantization_delta(linear, chosen) for linear in linears]
                cost[chosen.name] = float(
                    sum(
                        ((delta @ hessian) * delta).sum(1) @ weight
                        for delta, weight in zip(deltas, weights, strict=True)
                    )
                )
                bits[chosen.name] = sum(chosen.stored_bits(*linear.weight.shape, dtype_bits) for linear in linears)
            params = sum(linear.weight.numel() for linear in linears)
            unit = Unit([f"{ctx.name}.{name}" for name in group], params, bits, cost)
            key = EXPERTS.sub(".experts", group[0])
            units[key] = _merged(units[key], unit) if key in units else unit
        self.units.extend(units.values())


def _merged(first: Unit, second: Unit) -> Unit:
    """One unit of both: a layer's experts (gate, up and down of every expert) take one scheme, because transformers
    and vLLM load them as one fused MoE module with one quantization scheme (a checkpoint whose experts' gate/up
    and down differ loaded in transformers with logits 8% off ours)."""
    schemes = [name for name in first.bits if name in second.bits]
    return Unit(
        first.names + second.names,
        first.params + second.params,
        {name: first.bits[name] + second.bits[name] for name in schemes},
        {name: first.cost[name] + second.cost[name] for name in schemes},
    )


def measure_sensitivity(
    model: nn.Module,
    samples: torch.Tensor,
    candidates: list[str],
    ignore: list[str],
    weighting: str,
    device: torch.device,
    batch_size: int,
) -> list[Unit]:
    """Every unit's predicted loss and stored bits under each candidate (the model's weights are left as they are;
    MoE experts are unfused first, so each expert's own gradient and error count in its layer's expert units)."""
    unfuse_experts(model)
    fisher = output_fisher(model, samples, device, batch_size) if weighting == "fisher" else None
    stage = SensitivityStage(SensitivityConfig(candidates, ignore), fisher)
    compress_model(model, [stage], samples, device, batch_size)
    return stage.units
