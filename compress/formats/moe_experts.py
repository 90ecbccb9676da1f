"""Mixture-of-Experts blocks: one linear per expert, for the stages, the checkpoint and the runtime.

transformers 5 stores a MoE block's experts as fused 3-D parameters (``experts.gate_up_proj [E, 2I, H]``,
``experts.down_proj [E, H, I]``), which no stage here can see: they quantize ``nn.Linear`` modules. vLLM's
compressed-tensors MoE loader, and the hub checkpoints transformers itself writes, name one linear per expert
(``model.layers.L.mlp.experts.N.gate_proj.weight_packed``; Mixtral ``block_sparse_moe.experts.N.w1``). So a supported
family's fused experts module is replaced by :class:`UnfusedExperts`: a list of per-expert MLPs of plain linears with
the fused module's forward signature, while the family's own router and block keep routing tokens. Every stage then
treats an expert's linears like any MLP's, and the checkpoint carries per-expert names.

Calibration: an expert the router rarely picks would get few or no calibration tokens and be quantized from nothing.
While a stage gathers statistics (``all_tokens_through_experts``), every expert runs on *all* the layer's tokens, so
each one's statistics cover the whole calibration set, and only the routed tokens reach the layer's output (the
output is the model's own). The tokens the router did send to each expert are counted for the report.

A fused layout this module does not know (another family, transposed or interleaved ``gate_up_proj``, expert biases)
is refused by :func:`check_weights_handled` before any work, never silently left in full precision.

Imports only torch: the checkpoint loader rebuilds this structure on a bare runtime box.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from compress.base.errors import CompressError
from compress.formats import Fp8Linear, Int8Linear, QuantizedLinear


@dataclass(frozen=True)
class MoEFamily:
    """How a family's MoE block is laid out in hub checkpoints (what vLLM loads)."""

    projections: tuple[str, str, str]  # each expert's gate, up and down linear names
    routers: tuple[str, ...]  # modules of the block that route tokens (relative to it): never quantized
    checkpoint_block: str = "mlp"  # the block's name in checkpoints (Mixtral: block_sparse_moe; transformers: mlp)


GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
MOE_FAMILIES = {
    "mixtral": MoEFamily(("w1", "w3", "w2"), ("gate",), checkpoint_block="block_sparse_moe"),
    "qwen2_moe": MoEFamily(GATE_UP_DOWN, ("gate", "shared_expert_gate")),
    "qwen3_moe": MoEFamily(GATE_UP_DOWN, ("gate",)),
    "deepseek_v3": MoEFamily(GATE_UP_DOWN, ("gate",)),
}
LINEARS = (nn.Linear, QuantizedLinear, Int8Linear, Fp8Linear)
BLOCK = "mlp"  # where transformers keeps the MoE block in every supported family's decoder layer


class ExpertMLP(nn.Module):
    """One expert: ``down(act(gate(x)) * up(x))``, its linears under the checkpoint's names."""

    def __init__(self, names: tuple[str, str, str], gate: nn.Linear, up: nn.Linear, down: nn.Linear, act_fn):
        super().__init__()
        self.names = names
        for name, linear in zip(names, (gate, up, down), strict=True):
            self.add_module(name, linear)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, name) for name in self.names)
        return down(self.act_fn(gate(x)) * up(x))


class UnfusedExperts(nn.ModuleList):
    """Drop-in for a fused experts module: ``forward(hidden [tokens, H], top_k_index, top_k_weights)`` sums each
    token's chosen experts weighted by the router, like the fused module does."""

    def __init__(self, experts: list[ExpertMLP]):
        super().__init__(experts)
        self.all_tokens = False  # set while statistics are gathered: every expert sees every token
        self.routed_tokens = torch.zeros(len(experts), dtype=torch.long)  # per expert, last statistics pass
        self.statistics_tokens = 0  # tokens each expert's statistics saw in that pass
        self._pass_routed = torch.zeros(len(experts), dtype=torch.long)
        self._pass_tokens = 0

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        output = torch.zeros_like(hidden_states)
        if self.all_tokens:
            self._pass_tokens += hidden_states.shape[0]
        for index, expert in enumerate(self):
            token_index, slot = torch.where(top_k_index == index)
            if self.all_tokens:
                self._pass_routed[index] += token_index.numel()
                routed = expert(hidden_states)[token_index]
            elif token_index.numel():
                routed = expert(hidden_states[token_index])
            else:
                continue
            weighted = routed * top_k_weights[token_index, slot, None]
            output.index_add_(0, token_index, weighted.to(output.dtype))
        return output

    def begin_pass(self) -> None:
        self._pass_routed.zero_()
        self._pass_tokens = 0
        self.all_tokens = True

    def end_pass(self) -> None:
        """Keep the pass's counts if it reached the experts (a forward may stop before the MoE block)."""
        self.all_tokens = False
        if self._pass_tokens:
            self.routed_tokens = self._pass_routed.clone()
            self.statistics_tokens = self._pass_tokens


def moe_family(model: nn.Module) -> MoEFamily | None:
    return MOE_FAMILIES.get(getattr(model.config, "model_type", None))


@torch.no_grad()
def unfuse(fused: nn.Module, family: MoEFamily) -> UnfusedExperts:
    """Per-expert linears holding slices of ``fused``'s ``gate_up_proj [E, 2I, H]`` (gate rows first, as its
    forward's ``chunk(2)`` reads them) and ``down_proj [E, H, I]``."""
    gate_up, down = fused.gate_up_proj, fused.down_proj
    experts, doubled, hidden = gate_up.shape
    intermediate = doubled // 2
    built = []
    for index in range(experts):
        linears = []
        for weight in (gate_up[index, :intermediate], gate_up[index, intermediate:], down[index]):
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
            linear.weight = nn.Parameter(weight.clone(), requires_grad=False)
            linears.append(linear)
        built.append(ExpertMLP(family.projections, *linears, fused.act_fn))
    return UnfusedExperts(built)


def unfuse_experts(model: nn.Module) -> int:
    """Replace every fused experts module in the model's decoder layers by :class:`UnfusedExperts` (the function
    is unchanged); returns how many were replaced. All or nothing: if one has a layout we do not know, nothing is
    touched and :func:`check_weights_handled` refuses the model in the stages' ``prepare``."""
    family = moe_family(model)
    if family is None:
        return 0
    blocks = [getattr(layer, BLOCK, None) for layer in model.model.layers]
    fused = [block for block in blocks if not isinstance(getattr(block, "experts", None), UnfusedExperts | None)]
    if not all(_expected_layout(block.experts) for block in fused):
        return 0
    for block in fused:
        block.experts = unfuse(block.experts, family)
    return len(fused)


def _expected_layout(experts: nn.Module) -> bool:
    """``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (by the module's own ``hidden_dim`` and
    ``intermediate_dim``), no biases: the layout :func:`unfuse` reads."""
    names = {name for name, _ in experts.named_parameters(recurse=False)}
    dims = [getattr(experts, name, None) for name in ("num_experts", "hidden_dim", "intermediate_dim", "act_fn")]
    if names != {"gate_up_proj", "down_proj"} or None in dims:
        return False
    count, hidden, intermediate, _ = dims
    return tuple(experts.gate_up_proj.shape) == (count, 2 * intermediate, hidden) and tuple(
        experts.down_proj.shape
    ) == (count, hidden, intermediate)


ROUTERS = frozenset(f"{BLOCK}.{router}" for family in MOE_FAMILIES.values() for router in family.routers)


def router_names(model: nn.Module) -> list[str]:
    """Full module names of the model's routers (kept dense; listed in a checkpoint's ``ignore``)."""
    if moe_family(model) is None:
        return []
    return [
        f"model.layers.{index}.{name}"
        for index, layer in enumerate(model.model.layers)
        for name, _ in layer.named_modules()
        if name in ROUTERS
    ]


def check_weights_handled(model: nn.Module, stage: str) -> None:
    """One line naming the first weight of a decoder layer that ``stage`` would neither compress nor knowingly keep
    (a fused experts parameter of a layout or family we do not know): refusing beats a checkpoint that silently
    keeps it in full precision. Linears (dense or already quantized), norms, biases and routers are handled."""
    family = moe_family(model)
    for index, layer in enumerate(model.model.layers):
        for owner_name, owner in layer.named_modules():
            if isinstance(owner, LINEARS) or owner_name in ROUTERS:
                continue
            if family is not None and _expected_layout(owner):
                continue  # unfused into per-expert linears before the stage runs
            for parameter_name, parameter in owner.named_parameters(recurse=False):
                if parameter.dim() < 2:
                    continue
                model_type = getattr(model.config, "model_type", None)
                raise CompressError(
                    f"{stage}: model.layers.{index}.{owner_name}.{parameter_name} "
                    f"({list(parameter.shape)}, in {type(owner).__name__}) is a weight {stage} cannot compress "
                    f"(model type {model_type!r}); supported MoE families: {', '.join(sorted(MOE_FAMILIES))}"
                )


@contextmanager
def all_tokens_through_experts(layer: nn.Module) -> Iterator[None]:
    """While statistics are gathered: every expert of ``layer`` runs on all tokens (the output stays routed)."""
    experts = [m for m in layer.modules() if isinstance(m, UnfusedExperts)]
    for module in experts:
        module.begin_pass()
    try:
        yield
    finally:
        for module in experts:
            module.end_pass()


def expert_token_report(model: nn.Module) -> dict[str, dict]:
    """Per MoE block: the calibration tokens the router sent to each expert (in the last statistics pass) and the
    tokens every expert's statistics saw; experts the router never picked are named."""
    report = {}
    for name, module in model.named_modules():
        if isinstance(module, UnfusedExperts) and module.statistics_tokens:
            routed = module.routed_tokens.tolist()
            report[name] = {
                "routed_tokens_per_expert": routed,
                "statistics_tokens_per_expert": module.statistics_tokens,
                "never_routed": [index for index, count in enumerate(routed) if count == 0],
            }
    return report


LAYER_BLOCK = re.compile(rf"^(model\.layers\.\d+)\.{BLOCK}\.")


def checkpoint_name(model_type: str | None, name: str) -> str:
    """A module or tensor name as hub checkpoints (and vLLM) spell it."""
    family = MOE_FAMILIES.get(model_type)
    if family is None or family.checkpoint_block == BLOCK:
        return name
    return LAYER_BLOCK.sub(rf"\1.{family.checkpoint_block}.", name)


def model_name(model_type: str | None, name: str) -> str:
    """Inverse of :func:`checkpoint_name`."""
    family = MOE_FAMILIES.get(model_type)
    if family is None or family.checkpoint_block == BLOCK:
        return name
    return re.sub(rf"^(model\.layers\.\d+)\.{family.checkpoint_block}\.", rf"\1.{BLOCK}.", name)
