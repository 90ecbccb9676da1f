"""Hadamard rotations (QuaRot / SpinQuant style), folded into the weights offline so the checkpoint stays ordinary.

Outliers concentrate in a few channels of the residual stream; an orthogonal rotation spreads them over all channels,
which makes 4-bit weight grids (and 8-bit KV caches) far less lossy. Nothing changes at inference: the rotation is
multiplied into the weights around the stream, and the rotated model computes the same function.

- R1 (``residual``): the residual stream x becomes x·Q. RMSNorm commutes with Q once its scale is folded into the
  linears that read it (then the norm's scale is 1), so: embeddings E·Q; linears reading the stream W·diag(w)·Q;
  linears writing it (o_proj, down_proj) Qᵀ·W and their bias b·Q; the head W·diag(w_final)·Q. A tied head is untied
  (the head carries the final norm's scale, the embeddings do not). Gemma-2/3 normalise the attention and MLP outputs
  *before* they join the stream (sandwich norms), which does not commute with Q: R1 is refused there.
- R2 (``heads``): each value head v becomes v·R (R of head_dim), folded into v_proj's rows and o_proj's columns.

Q is a Hadamard matrix (Sylvester ⊗ Paley, e.g. 576 = 12·12·4) times random signs, scaled to be orthogonal; a width
with no such construction gets a random orthogonal matrix (QR of a Gaussian), which is as exact but spreads less
evenly. Everything is computed in float64 and stored back in the weights' dtype.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from compress.base.errors import CompressError
from compress.model.layer_walk import decoder_layers
from compress.stages.base import Stage
from compress.stages.mappings import Mapping, family_mappings, previous_rows

WRITERS = ("self_attn.o_proj", "mlp.down_proj")  # the linears whose outputs join the residual stream
SANDWICH_NORMS = ("post_feedforward_layernorm",)  # a norm after a sublayer's output: R1 cannot pass through it
KINDS = ("hadamard", "random")
log = logging.getLogger(__name__)
FUSED_VALUES = Mapping("self_attn.qkv_proj", ("self_attn.o_proj",), rows="v")  # Phi-3: the v rows of qkv_proj


@dataclass
class RotateConfig:
    residual: bool = True  # R1: rotate the residual stream
    heads: bool = True  # R2: rotate each value head (v_proj rows, o_proj columns)
    kind: str = "hadamard"  # hadamard (random signs) | random (random orthogonal)
    seed: int = 0  # draws the random signs or the random orthogonal matrices

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r} must be one of {', '.join(KINDS)}")
        if not (self.residual or self.heads):
            raise ValueError("nothing to rotate: set residual=true and/or heads=true")


class RotateStage(Stage):
    name = "rotate"
    Config = RotateConfig
    needs_calibration = False
    layerwise = False  # the embeddings, every layer and the head move together
    needs_dense_weights = True  # rotates dense weights: must precede any quantizer

    def prepare(self, model: nn.Module) -> None:
        self.family = family_mappings(model, "rotate", norms_only=True)
        self.rotated: dict[str, int | str] = {}
        self.residual = self.config.residual
        if self.residual and any(hasattr(decoder_layers(model)[0], n) for n in SANDWICH_NORMS):
            why = f"{model.config.model_type!r} normalises each sublayer's output before the residual add"
            if not self.config.heads:
                raise CompressError(
                    f"rotate: {why}, which a residual rotation cannot pass through, and heads=false leaves nothing "
                    "to rotate; set heads=true or drop the rotate stage"
                )
            log.warning("rotate: %s, which a residual rotation cannot pass through: rotating value heads only", why)
            self.residual = False
            self.rotated["residual"] = "skipped: sandwich norms"
        self.generator = torch.Generator().manual_seed(self.config.seed)

    @torch.no_grad()
    def process_model(self, model: nn.Module, samples: torch.Tensor, device: torch.device) -> None:
        if self.residual:
            self._rotate_residual(model)
        if self.config.heads:
            self._rotate_heads(model)

    def _rotate_residual(self, model: nn.Module) -> None:
        config = model.config
        q = orthogonal(config.hidden_size, self.config.kind, self.generator)
        offset = self.family.norm_offset
        embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
        final_scale = model.model.norm.weight.double() + offset
        head_weight = head.weight.double() * final_scale  # fold the final norm's scale into the head
        if head.weight is embeddings.weight:  # untie: the head now differs from the embeddings
            head.weight = nn.Parameter(head.weight.detach().clone())
            config.tie_word_embeddings = False
            if getattr(config, "text_config", None) is not None:
                config.text_config.tie_word_embeddings = False
        _assign(head, head_weight @ q)
        _assign(embeddings, embeddings.weight.double() @ q)
        _set_unit_scale(model.model.norm, offset)
        for layer in decoder_layers(model):
            for mapping in self.family.mappings:  # norm → the linears reading it
                norm = layer.get_submodule(mapping.previous)
                scale = norm.weight.double() + offset
                for name in mapping.linears:
                    linear = layer.get_submodule(name)
                    _assign(linear, (linear.weight.double() * scale) @ q)
                _set_unit_scale(norm, offset)
            for name in WRITERS:
                linear = layer.get_submodule(name)
                _assign(linear, q.T @ linear.weight.double())
                if linear.bias is not None:
                    linear.bias.data = (linear.bias.double() @ q).to(linear.bias.dtype)
        self.rotated["residual_width"] = config.hidden_size

    def _rotate_heads(self, model: nn.Module) -> None:
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        r = orthogonal(head_dim, self.config.kind, self.generator)
        kv_heads, heads = config.num_key_value_heads, config.num_attention_heads
        for layer in decoder_layers(model):
            attention = layer.self_attn
            fused = hasattr(attention, "qkv_proj")
            v_proj = attention.qkv_proj if fused else attention.v_proj
            rows = previous_rows(FUSED_VALUES, config) if fused else slice(None)
            weight = v_proj.weight.data
            values = weight[rows].double().view(kv_heads, head_dim, -1)
            weight[rows] = torch.einsum("de,hdi->hei", r, values).reshape(-1, weight.shape[1]).to(weight.dtype)
            if v_proj.bias is not None:
                bias = v_proj.bias.data
                bias[rows] = (bias[rows].double().view(kv_heads, head_dim) @ r).reshape(-1).to(bias.dtype)
            o_proj = attention.o_proj
            columns = o_proj.weight.double().view(-1, heads, head_dim)
            _assign(o_proj, (columns @ r).reshape(o_proj.weight.shape))
        self.rotated["head_dim"] = head_dim

    def finalize(self, model: nn.Module) -> dict:
        return {"kind": self.config.kind, "seed": self.config.seed, **self.rotated}


def _assign(module: nn.Module, weight: torch.Tensor) -> None:
    module.weight.data = weight.to(module.weight.dtype).contiguous()


def _set_unit_scale(norm: nn.Module, offset: float) -> None:
    """The norm's effective scale (offset + weight) becomes 1: its scale now lives in the linears it feeds."""
    norm.weight.data.fill_(1.0 - offset)


def orthogonal(size: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """A float64 orthogonal ``size``×``size`` matrix: a Hadamard matrix with random column signs, scaled by
    1/√size, when one can be built for ``size``; otherwise (or for ``kind="random"``) a random orthogonal one."""
    hadamard = hadamard_matrix(size) if kind == "hadamard" else None
    if hadamard is None:
        gaussian = torch.randn(size, size, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(gaussian)
        return q * torch.sign(torch.diagonal(r))  # sign fix: uniformly distributed over the orthogonal group
    signs = torch.randint(0, 2, (size,), generator=generator).double() * 2 - 1
    return hadamard * signs / math.sqrt(size)


def hadamard_matrix(size: int) -> torch.Tensor | None:
    """A ±1 Hadamard matrix of order ``size`` built as Sylvester (2^k) ⊗ Paley (q + 1 for a prime q ≡ 3 mod 4)
    factors, or None when ``size`` does not factor that way."""
    if size == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    if size % 2 == 0 and hadamard_matrix(size // 2) is not None and _is_power_of_two(size):
        half = hadamard_matrix(size // 2)
        return torch.cat([torch.cat([half, half], 1), torch.cat([half, -half], 1)], 0)
    for order in _paley_orders(size):
        rest = hadamard_matrix(size // order)
        if rest is not None:
            return torch.kron(_paley(order), rest)
    return None


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _paley_orders(size: int) -> list[int]:
    """Orders q + 1 (q prime, q ≡ 3 mod 4) that divide ``size``, largest first; 2^k factors come from Sylvester."""
    orders = []
    for q in range(3, size):
        if (size % (q + 1) == 0) and q % 4 == 3 and all(q % d for d in range(2, math.isqrt(q) + 1)):
            orders.append(q + 1)
    orders = [o for o in orders if not _is_power_of_two(o)]
    if _is_power_of_two(size):
        return []
    return sorted(orders, reverse=True) or ([2] if size % 2 == 0 else [])


def _paley(order: int) -> torch.Tensor:
    """Paley construction I: the Hadamard matrix of order q + 1 for a prime q ≡ 3 (mod 4)."""
    if order == 2:
        return torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    q = order - 1
    squares = {(x * x) % q for x in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if a in squares else -1.0 for a in range(1, q)], dtype=torch.float64)
    jacobsthal = torch.stack([chi[(torch.arange(q) - i) % q] for i in range(q)])  # Q[i, j] = χ(j − i)
    matrix = torch.ones(order, order, dtype=torch.float64)
    matrix[1:, 0] = -1
    matrix[1:, 1:] = jacobsthal + torch.eye(q, dtype=torch.float64)
    return matrix
