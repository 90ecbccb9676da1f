"""Where scale-folding stages (AWQ, SmoothQuant) may move a per-channel scale, for every supported family.

A mapping names an operation (a norm or a linear) whose outputs are the inputs of some linears: dividing those
outputs by ``s`` and multiplying the linears' input columns by ``s`` leaves the float model unchanged. What differs
between families, and must be exact or the "unchanged" model silently is not:

- Gemma-2/3 RMSNorms scale by ``(1 + weight)``, so dividing the effective scale by ``s`` means
  ``weight ← (1 + weight) / s − 1``, not ``weight / s``;
- Gemma-2/3 use sandwich norms: the attention output goes through ``post_attention_layernorm`` before the residual,
  and the MLP reads ``pre_feedforward_layernorm`` (folding into ``post_attention_layernorm`` would change the model);
- Phi-3 fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``: the value→output mapping may only scale the
  v rows of ``qkv_proj`` and the up→down mapping only the up half of ``gate_up_proj``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from compress.calibration import decoder_layers
from compress.errors import CompressError


@dataclass(frozen=True)
class Mapping:
    """``previous`` produces the input of every linear in ``linears``; scales fold into it. ``rows`` names the slice
    of a fused ``previous`` linear that feeds them ("v" of a fused qkv, "up" of a fused gate/up), None for all."""

    previous: str
    linears: tuple[str, ...]
    rows: str | None = None


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
FAMILY_MAPPINGS = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
    "gemma2": GEMMA,
    "gemma3_text": GEMMA,
    "phi3": PHI3,
}


def family_mappings(model: nn.Module, stage: str, norms_only: bool = False) -> FamilyMappings:
    """The model family's mappings (only those folding into a norm with ``norms_only``), checked against its first
    decoder layer, or one line naming the family and the supported ones."""
    family = getattr(model.config, "model_type", None)
    if family not in FAMILY_MAPPINGS:
        raise CompressError(
            f"{stage}: no scale mapping for model type {family!r}; supported: {', '.join(sorted(FAMILY_MAPPINGS))}"
        )
    layer = decoder_layers(model)[0]
    spec = FAMILY_MAPPINGS[family]
    for mapping in spec.mappings:
        for name in (mapping.previous, *mapping.linears):
            try:
                layer.get_submodule(name)
            except AttributeError as error:
                raise CompressError(f"{stage} mapping for {family!r} expects module {name!r} in each layer") from error
    if norms_only:
        norm_mappings = tuple(m for m in spec.mappings if not isinstance(layer.get_submodule(m.previous), nn.Linear))
        return FamilyMappings(norm_mappings, spec.norm_offset)
    return spec


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
    for name in mapping.linears:
        linear = layer.get_submodule(name)
        linear.weight.data = (linear.weight.data.float() * per_input).to(linear.weight.dtype)
