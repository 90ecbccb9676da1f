"""Where scale-folding stages (AWQ, SmoothQuant) may move a per-channel scale, for every supported family.

A mapping names an operation (a norm or a linear) whose outputs are the inputs of some linears: dividing those
outputs by ``s`` and multiplying the linears' input columns by ``s`` leaves the float model unchanged. What differs
between families, and must be exact or the "unchanged" model silently is not:

- Gemma-2/3 RMSNorms scale by ``(1 + weight)``, so dividing the effective scale by ``s`` means
  ``weight ← (1 + weight) / s − 1``, not ``weight / s``;
- Gemma-2/3 use sandwich norms: the attention output goes through ``post_attention_layernorm`` before the residual,
  and the MLP reads ``pre_feedforward_layernorm`` (folding into ``post_attention_layernorm`` would change the model);
- Phi-3 fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``: the value→output mapping may only scale the
  v rows of ``qkv_proj`` and the up→down mapping only the up half of ``gate_up_proj``;
- MoE blocks (experts unfused into per-expert linears by ``compress.formats.moe_experts``): the post-attention norm
  feeds every expert's gate/up (and a shared expert's), so they share one scale, and it feeds the router too, whose
  input columns must absorb the same scale (``followers``: folded, never quantized) or routing would change. ``*`` in a
  name stands for every expert index; a mapping whose ``previous`` has one is one mapping per expert (each expert's up
  feeds its own down).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
from torch import nn

from compress.base.errors import CompressError
from compress.model.layer_walk import decoder_layers
from compress.stages.base import FP32_BYTES, LayerWork


@dataclass(frozen=True)
class Mapping:
    """``previous`` produces the input of every linear in ``linears``; scales fold into it. ``rows`` names the slice
    of a fused ``previous`` linear that feeds them ("v" of a fused qkv, "up" of a fused gate/up), None for all."""

    previous: str
    linears: tuple[str, ...]
    rows: str | None = None
    followers: tuple[str, ...] = ()  # also read ``previous``'s outputs; get the scale folded, stay unquantized


@dataclass(frozen=True)
class FamilyMappings:
    mappings: tuple[Mapping, ...]
    norm_offset: float = 0.0  # the norm multiplies by (norm_offset + weight): 1 for Gemma, 0 elsewhere


ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
MLP_IN = ("mlp.gate_proj", "mlp.up_proj")
LLAMA = FamilyMappings(
    (
        Mapping("input_layernorm", ATTENTION),
        Mapping("self_attn.v_proj", ("self_attn.o_proj",)),
        Mapping("post_attention_layernorm", MLP_IN),
        Mapping("mlp.up_proj", ("mlp.down_proj",)),
    )
)
GEMMA = FamilyMappings(
    (
        Mapping("input_layernorm", ATTENTION),
        Mapping("self_attn.v_proj", ("self_attn.o_proj",)),
        Mapping("pre_feedforward_layernorm", MLP_IN),
        Mapping("mlp.up_proj", ("mlp.down_proj",)),
    ),
    norm_offset=1.0,
)
PHI3 = FamilyMappings(
    (
        Mapping("input_layernorm", ("self_attn.qkv_proj",)),
        Mapping("self_attn.qkv_proj", ("self_attn.o_proj",), rows="v"),
        Mapping("post_attention_layernorm", ("mlp.gate_up_proj",)),
        Mapping("mlp.gate_up_proj", ("mlp.down_proj",), rows="up"),
    )
)


def _moe(gate: str, up: str, down: str, shared: str | None = None, routers: tuple[str, ...] = ("mlp.gate",)):
    """Llama attention; the MoE block's experts (and shared expert) reading the post-attention norm."""
    experts_in = (f"mlp.experts.*.{gate}", f"mlp.experts.*.{up}")
    shared_in = (f"mlp.{shared}.gate_proj", f"mlp.{shared}.up_proj") if shared else ()
    down_mappings = [Mapping(f"mlp.experts.*.{up}", (f"mlp.experts.*.{down}",))]
    if shared:
        down_mappings.append(Mapping(f"mlp.{shared}.up_proj", (f"mlp.{shared}.down_proj",)))
    return FamilyMappings(
        (
            *LLAMA.mappings[:2],
            Mapping("post_attention_layernorm", experts_in + shared_in, followers=routers),
            *down_mappings,
        )
    )


FAMILY_MAPPINGS = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
    "gemma2": GEMMA,
    "gemma3_text": GEMMA,
    "phi3": PHI3,
    "mixtral": _moe("w1", "w3", "w2"),
    "qwen3_moe": _moe("gate_proj", "up_proj", "down_proj"),
    "qwen2_moe": _moe("gate_proj", "up_proj", "down_proj", "shared_expert", ("mlp.gate", "mlp.shared_expert_gate")),
}


def layer_mappings(layer: nn.Module, mappings: tuple[Mapping, ...]) -> list[Mapping]:
    """``mappings`` with every ``*`` resolved against ``layer``'s modules (see the module docstring)."""
    names = [name for name, _ in layer.named_modules()]
    resolved = []
    for mapping in mappings:
        if "*" in mapping.previous:
            for index in _indices(names, mapping.previous):
                resolved.append(
                    replace(
                        mapping,
                        previous=mapping.previous.replace("*", index),
                        linears=tuple(n.replace("*", index) for n in mapping.linears),
                        followers=tuple(n.replace("*", index) for n in mapping.followers),
                    )
                )
            continue
        linears = tuple(
            resolved_name
            for pattern in mapping.linears
            for resolved_name in ([pattern] if "*" not in pattern else _matching(names, pattern))
        )
        resolved.append(replace(mapping, linears=linears))
    return resolved


def _pattern(pattern: str) -> re.Pattern:
    return re.compile(re.escape(pattern).replace(r"\*", r"(\d+)") + "$")


def _indices(names: list[str], pattern: str) -> list[str]:
    regex = _pattern(pattern)
    return [match.group(1) for match in map(regex.match, names) if match]


def _matching(names: list[str], pattern: str) -> list[str]:
    regex = _pattern(pattern)
    return [name for name in names if regex.match(name)]


def family_mappings(model: nn.Module, stage: str, norms_only: bool = False) -> FamilyMappings:
    """The model family's mappings (only those folding into a norm with ``norms_only``), checked against its first
    decoder layer, or one line naming the family and the supported ones."""
    family = getattr(model.config, "model_type", None)
    if family not in FAMILY_MAPPINGS:
        raise CompressError(
            f"{stage}: no scale mapping for model type {family!r}; supported: {', '.join(sorted(FAMILY_MAPPINGS))}"
        )
    spec = FAMILY_MAPPINGS[family]
    for layer in decoder_layers(model):
        for mapping in spec.mappings:
            missing = _missing(layer, mapping)
            if missing is not None:
                raise CompressError(f"{stage} mapping for {family!r} expects module {missing!r} in each layer")
    layer = decoder_layers(model)[0]
    if norms_only:
        norm_mappings = tuple(
            m
            for m in spec.mappings
            if "*" not in m.previous and not isinstance(layer.get_submodule(m.previous), nn.Linear)
        )  # a per-expert previous is an expert's up_proj
        return FamilyMappings(norm_mappings, spec.norm_offset)
    return spec


def _missing(layer: nn.Module, mapping: Mapping) -> str | None:
    """The first name of ``mapping`` that ``layer`` lacks (a ``*`` name that matches no module counts), or None."""
    names = [name for name, _ in layer.named_modules()]
    patterns = (mapping.previous,) if "*" in mapping.previous else mapping.linears
    for pattern in patterns:
        if "*" in pattern and not _matching(names, pattern):
            return pattern
    for resolved in layer_mappings(layer, (mapping,)):
        for name in (resolved.previous, *resolved.linears, *resolved.followers):
            if name not in names:
                return name
    return None


def previous_rows(mapping: Mapping, config) -> slice:
    """Output rows of ``mapping.previous`` that feed its linears."""
    if mapping.rows is None:
        return slice(None)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if mapping.rows == "v":  # Phi-3 qkv_proj: [q (heads·d) | k (kv_heads·d) | v (kv_heads·d)]
        start = (config.num_attention_heads + config.num_key_value_heads) * head_dim
        return slice(start, start + config.num_key_value_heads * head_dim)
    if mapping.rows == "up":  # Phi-3 gate_up_proj: [gate | up], each intermediate_size wide
        return slice(config.intermediate_size, 2 * config.intermediate_size)
    raise ValueError(f"unknown fused rows {mapping.rows!r}")


def previous_width(layer: nn.Module, mapping: Mapping, config) -> int:
    """How many channels the scale has: the previous op's outputs that feed the linears."""
    previous = layer.get_submodule(mapping.previous)
    if not isinstance(previous, nn.Linear):
        return previous.weight.shape[0]
    return len(range(previous.out_features)[previous_rows(mapping, config)])


@torch.no_grad()
def fold_scale(
    layer: nn.Module, mapping: Mapping, scale: torch.Tensor, per_input: torch.Tensor, config, norm_offset: float
) -> None:
    """Divide the previous op's outputs by ``scale`` and multiply the linears' inputs by ``per_input`` (``scale``
    expanded to their input width): the float model is unchanged."""
    previous = layer.get_submodule(mapping.previous)
    if isinstance(previous, nn.Linear):
        rows = previous_rows(mapping, config)
        weight = previous.weight.data
        weight[rows] = (weight[rows].float() / scale[:, None]).to(weight.dtype)
    else:
        effective = previous.weight.data.float() + norm_offset
        previous.weight.data = (effective / scale - norm_offset).to(previous.weight.dtype)
        rows = slice(None)
    bias = getattr(previous, "bias", None)
    if bias is not None:
        bias.data[rows] = (bias.data[rows].float() / scale).to(bias.dtype)
    for name in (*mapping.linears, *mapping.followers):
        linear = layer.get_submodule(name)
        linear.weight.data = (linear.weight.data.float() * per_input).to(linear.weight.dtype)


def scale_search_bytes(work: LayerWork) -> float:
    """The peak of a stage that chooses scales from the activations of a mapping (AWQ, SmoothQuant): the inputs'
    statistics square in the widest input and candidate copies of the largest linear."""
    return 4 * work.widest * work.widest * FP32_BYTES + 2 * work.largest * FP32_BYTES
