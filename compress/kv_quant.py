"""KV-cache quantization as a runtime sees it: K (after rotary) and V rounded to 8 bits with calibrated scales.

A runtime that honours a checkpoint's ``kv_cache_scheme`` stores K/V as ``round(x / scale)`` in fp8 e4m3 or int8 and
multiplies back when attending. ``enable_kv_fake_quant`` reproduces that in the transformers attention path
(through a registered attention implementation that wraps SDPA), so perplexity measures the cache's real error.
The scales live on each attention module as ``k_scale``/``v_scale`` buffers: shape ``[1]`` per tensor or
``[kv_heads, 1, 1]`` per KV head, the compressed-tensors layout.

Imports only torch and transformers: checkpoints carrying a KV scheme load on a bare GPU box.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask, sdpa_mask

from compress.errors import CompressError
from kernels.dtypes import KV_CACHE_DTYPES, QUANT_MAX

ATTENTION_NAME = "compress_kv_quant"
EAGER_ATTENTION_NAME = "compress_kv_quant_eager"  # logit soft-capping (Gemma-2), which SDPA cannot do
STRATEGIES = ("tensor", "attn_head")
CACHE_DTYPE_OF_TYPE = {"float": "fp8", "int": "int8"}  # compressed-tensors `type` → KV-cache dtype name
TYPES = tuple(CACHE_DTYPE_OF_TYPE)


@dataclass(frozen=True)
class KVCacheScheme:
    type: str = "float"  # float: fp8 e4m3; int: int8 symmetric
    strategy: str = "tensor"  # tensor: one scale per layer for K and one for V; attn_head: one per KV head

    def __post_init__(self):
        if self.type not in TYPES:
            raise CompressError(f"kv cache type={self.type!r} is not supported; use one of {', '.join(TYPES)}")
        if self.strategy not in STRATEGIES:
            raise CompressError(
                f"kv cache strategy={self.strategy!r} is not supported; use one of {', '.join(STRATEGIES)}"
            )

    @property
    def kv_cache_dtype(self) -> str:
        """The cache dtype these scales are calibrated for (``fp8``/``int8``), as the engine and the gate name it."""
        return CACHE_DTYPE_OF_TYPE[self.type]

    @property
    def qmax(self) -> float:
        return QUANT_MAX[KV_CACHE_DTYPES[self.kv_cache_dtype]]

    def to_dict(self) -> dict:
        """The ``kv_cache_scheme`` block of a compressed-tensors ``quantization_config``."""
        return {
            "num_bits": 8,
            "type": self.type,
            "symmetric": True,
            "strategy": self.strategy,
            "dynamic": False,
            "group_size": None,
            "block_structure": None,
            "actorder": None,
            "observer": "minmax",
        }

    @classmethod
    def from_dict(cls, block: dict) -> KVCacheScheme:
        if block.get("num_bits") != 8 or not block.get("symmetric", True) or block.get("dynamic"):
            raise CompressError(f"kv_cache_scheme {block} is not supported; compress reads static symmetric 8-bit")
        return cls(type=block.get("type", "float"), strategy=block.get("strategy", "tensor"))


def fake_quantize_kv(states: torch.Tensor, scale: torch.Tensor, scheme: KVCacheScheme) -> torch.Tensor:
    """Round ``states [batch, kv_heads, seq, head_dim]`` to the 8-bit grid given by ``scale`` and back."""
    scaled = (states.float() / scale.float()).clamp(-scheme.qmax, scheme.qmax)
    if scheme.type == "float":
        rounded = scaled.to(torch.float8_e4m3fn).float()
    else:
        rounded = torch.round(scaled)
    return (rounded * scale.float()).to(states.dtype)


def _cached_kv(module: nn.Module, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V as the cache holds them: shown to the calibration observer, then rounded when scales are set."""
    observer: Callable | None = getattr(module, "kv_observer", None)
    if observer is not None:
        observer(key, value)
    scheme: KVCacheScheme | None = getattr(module, "kv_scheme", None)
    if scheme is not None:
        key = fake_quantize_kv(key, module.k_scale, scheme)
        value = fake_quantize_kv(value, module.v_scale, scheme)
    return key, value


def _attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    key, value = _cached_kv(module, key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _eager_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """The model family's own eager attention (every transformers model file defines one), for soft-capped logits."""
    key, value = _cached_kv(module, key, value)
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(ATTENTION_NAME, _attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
AttentionInterface.register(EAGER_ATTENTION_NAME, _eager_attention)
AttentionMaskInterface.register(EAGER_ATTENTION_NAME, eager_mask)


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``name → self_attn`` of every decoder layer."""
    found = {
        name: m
        for name, m in model.named_modules()
        if name.endswith("self_attn") and (hasattr(m, "k_proj") or hasattr(m, "qkv_proj"))  # qkv_proj: Phi-3
    }
    if not found:
        raise CompressError(
            f"{type(model).__name__} has no `self_attn` modules with k_proj/v_proj (or a fused qkv_proj) to quantize "
            "K/V of"
        )
    return found


def route_attention(model: nn.Module) -> None:
    """Send every attention call through the KV-quantizing wrapper (a no-op until scales or observers are set)."""
    soft_capped = getattr(model.config, "attn_logit_softcapping", None) is not None
    model.config._attn_implementation = EAGER_ATTENTION_NAME if soft_capped else ATTENTION_NAME


def set_scales(attention: nn.Module, k_scale: torch.Tensor, v_scale: torch.Tensor, scheme: KVCacheScheme) -> None:
    """Attach calibrated scales and switch this attention module to quantized K/V."""
    for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not torch.isfinite(value).all() or not bool((value > 0).all()):
            raise CompressError(f"{name} {value.flatten().tolist()} is not a positive finite scale")
        if name in attention._buffers:
            attention._buffers[name] = value.detach().clone()
        else:
            attention.register_buffer(name, value.detach().clone())
    attention.kv_scheme = scheme


def calibrated_kv_cache_dtype(model: nn.Module) -> str | None:
    """The KV-cache dtype the model's attention scales were calibrated for (set by the KV-cache stage or by loading
    a checkpoint with a ``kv_cache_scheme``), so a runtime can honour it; None when the model carries none."""
    found = {m.kv_scheme.kv_cache_dtype for m in model.modules() if getattr(m, "kv_scheme", None) is not None}
    if len(found) > 1:
        raise CompressError(f"attention modules carry KV scales for {sorted(found)}; a model has one KV-cache dtype")
    return found.pop() if found else None


def enable_kv_fake_quant(model: nn.Module, scheme: KVCacheScheme) -> None:
    """Quantize K/V in every attention module that holds ``k_scale``/``v_scale`` buffers."""
    modules = attention_modules(model)
    missing = [name for name, m in modules.items() if not hasattr(m, "k_scale") or not hasattr(m, "v_scale")]
    if missing:
        raise CompressError(f"kv cache scales missing for {missing[:3]}; the checkpoint is incomplete")
    for attention in modules.values():
        set_scales(attention, attention.k_scale, attention.v_scale, scheme)
    route_attention(model)
