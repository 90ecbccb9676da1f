"""KV-cache quantization as a runtime sees it: K (after rotary) and V rounded to 8 bits with calibrated scales.

A runtime that honours a checkpoint's ``kv_cache_scheme`` stores K/V as ``round(x / scale)`` in fp8 e4m3 or int8 and
multiplies back when attending. ``enable_kv_fake_quant`` reproduces that in the transformers attention path
(through a registered attention implementation that wraps SDPA), so perplexity measures the cache's real error.
The scales live on each attention module as ``k_scale``/``v_scale`` buffers: shape ``[1]`` per tensor or
``[kv_heads, 1, 1]`` per KV head, the compressed-tensors layout.

Imports only torch, transformers and our kernels: checkpoints carrying a KV scheme load on a bare GPU box.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask, sdpa_mask

from compress.base.errors import CompressError
from compress.kernels.dtypes import KV_CACHE_DTYPES, QUANT_MAX, is_quantized, kv_cache_dtype_name
from compress.kernels.kv_cache import dequantize_reference, per_token_scale, quantize_reference

ATTENTION_NAME = "compress_kv_quant"
EAGER_ATTENTION_NAME = "compress_kv_quant_eager"  # logit soft-capping (Gemma-2), which SDPA cannot do
STRATEGIES = ("tensor", "attn_head")
CACHE_DTYPE_OF_TYPE = {"float": "fp8", "int": "int8"}  # compressed-tensors `type` → KV-cache dtype name
TYPE_OF_CACHE_DTYPE = {dtype: kind for kind, dtype in CACHE_DTYPE_OF_TYPE.items()}  # recipe's `dtype` → `type`
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
    def storage_dtype(self) -> torch.dtype:
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def qmax(self) -> float:
        return QUANT_MAX[self.storage_dtype]

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


def fake_quantize_kv(states: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``states [..., head_dim]`` after a round trip through a ``dtype`` KV cache, rounded by the engine's own
    reference code (``compress.kernels.kv_cache``), so the KV-cache stage, the gate and the engine round alike.

    ``scale`` broadcasts against ``states``: ``[1]`` per tensor or ``[kv_heads, 1, 1]`` per KV head (calibrated);
    None computes one per token and head, as the engine does without calibrated scales. A float ``dtype`` is a plain
    cast there and back."""
    if not is_quantized(dtype):
        return states.to(dtype).to(states.dtype)
    if scale is None:
        scale = per_token_scale(states, dtype)
    return dequantize_reference(quantize_reference(states, scale, dtype), scale[..., 0], states.dtype)


def resolve_kv_cache_dtype(requested: str | None, model_dtype: torch.dtype, calibrated: str | None) -> str:
    """The KV-cache dtype a runtime runs, the one rule for the engine and the gate's transformers generator.

    ``auto`` (or None) takes the dtype the model's K/V scales were calibrated for (``calibrated``, from its
    ``kv_cache_scheme``), else the model's dtype. An explicit 8-bit dtype other than the calibrated one is refused:
    those scales are ``amax / qmax`` of the other format and would clip or waste its range. An explicit float dtype is
    allowed: the cache then stores K/V as computed and the scales go unused, as vLLM does, which is how one measures
    what the calibrated 8-bit cache costs; nothing is misread."""
    requested = requested or "auto"
    if requested == "auto":
        return calibrated or kv_cache_dtype_name(model_dtype)
    if requested not in KV_CACHE_DTYPES:
        raise CompressError(f"kv_cache_dtype={requested!r} is unknown; use auto or one of {list(KV_CACHE_DTYPES)}")
    if calibrated is not None and is_quantized(KV_CACHE_DTYPES[requested]) and requested != calibrated:
        raise CompressError(
            f"kv_cache_dtype={requested!r}, but the model's K/V scales are calibrated for {calibrated}; use auto "
            f"(or {calibrated}), or a float dtype for an unquantized cache"
        )
    return requested


def _cached_kv(module: nn.Module, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V as the cache holds them: shown to the calibration observer, then rounded when scales are set."""
    observer: Callable | None = getattr(module, "kv_observer", None)
    if observer is not None:
        observer(key, value)
    scheme: KVCacheScheme | None = getattr(module, "kv_scheme", None)
    if scheme is not None:
        key = fake_quantize_kv(key, scheme.storage_dtype, module.k_scale)
        value = fake_quantize_kv(value, scheme.storage_dtype, module.v_scale)
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


@contextmanager
def calibrated_kv_unused(model: nn.Module) -> Iterator[None]:
    """Attention sees K/V as computed while inside: what a runtime with a float cache does with calibrated scales."""
    schemes = {m: m.kv_scheme for m in model.modules() if getattr(m, "kv_scheme", None) is not None}
    for attention in schemes:
        attention.kv_scheme = None
    try:
        yield
    finally:
        for attention, scheme in schemes.items():
            attention.kv_scheme = scheme
