"""KV-cache quantization: calibrate static K/V scales (per tensor or per KV head) for fp8 e4m3 or int8.

K is observed after rotary embedding, exactly what a runtime writes to its cache. Placed after a weight quantizer in
the recipe, it calibrates against the quantized layer, and each calibrated layer then runs with quantized K/V, so the
next layer's calibration inputs carry the cache's error as inference will. The scales go into the checkpoint as
``<attn>.k_scale``/``<attn>.v_scale`` with a ``kv_cache_scheme`` block, which vLLM-style runtimes honour.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from compress.base import distributed
from compress.base.errors import CompressError
from compress.grids.kv_quant import TYPE_OF_CACHE_DTYPE, KVCacheScheme, attention_modules, route_attention, set_scales
from compress.stages.base import LayerContext, Stage


@dataclass
class KVCacheConfig:
    dtype: str = "fp8"  # fp8 (e4m3) | int8
    strategy: str = "attn_head"  # attn_head: one scale per KV head | tensor: one per layer

    def __post_init__(self):
        if self.dtype not in TYPE_OF_CACHE_DTYPE:
            raise ValueError(f"dtype={self.dtype!r} must be one of {', '.join(TYPE_OF_CACHE_DTYPE)}")
        KVCacheScheme(TYPE_OF_CACHE_DTYPE[self.dtype], self.strategy)


class KVCacheStage(Stage):
    name = "kv_cache"
    Config = KVCacheConfig
    quantizes_kv_cache = True  # a second KV quantizer would overwrite these scales

    @property
    def scheme(self) -> KVCacheScheme:
        return KVCacheScheme(TYPE_OF_CACHE_DTYPE[self.config.dtype], self.config.strategy)

    @property
    def kv_cache_scheme(self) -> dict:
        """What the pipeline writes into the checkpoint's ``quantization_config``."""
        return self.scheme.to_dict()

    def prepare(self, model: nn.Module) -> None:
        attention_modules(model)
        route_attention(model)
        self.scales: dict[str, dict] = {}

    @torch.no_grad()
    def process_layer(self, ctx: LayerContext) -> None:
        if ctx.inputs is None:
            raise CompressError("kv_cache needs calibration inputs")
        attention = ctx.layer.self_attn
        peaks: dict[str, torch.Tensor] = {}

        def observe(key: torch.Tensor, value: torch.Tensor) -> None:
            for name, states in (("k", key), ("v", value)):
                peak = states.detach().abs().float().amax(dim=(0, 2, 3))  # [kv_heads]
                if not torch.isfinite(peak).all():
                    raise CompressError(f"{ctx.name}.self_attn: {name.upper()} holds NaN/inf during calibration")
                peaks[name] = peak if name not in peaks else torch.maximum(peaks[name], peak)

        attention.kv_observer = observe
        try:
            for hidden, kwargs in zip(ctx.inputs.hidden, ctx.inputs.kwargs, strict=True):
                ctx.layer(hidden, **kwargs)
        finally:
            del attention.kv_observer
        scheme = self.scheme
        dtype = ctx.dtype
        scales = {}
        for name, peak in peaks.items():
            peak = distributed.all_reduce_max(peak).clamp(min=1e-6)
            scale = peak.amax().reshape(1) if scheme.strategy == "tensor" else peak.reshape(-1, 1, 1)
            scales[name] = (scale / scheme.qmax).to(dtype)
        set_scales(attention, scales["k"], scales["v"], scheme)
        self.scales[f"{ctx.name}.self_attn"] = {
            "k_scale_max": float(scales["k"].max()),
            "v_scale_max": float(scales["v"].max()),
        }

    def finalize(self, model: nn.Module) -> dict:
        return {"kv_cache_scheme": self.kv_cache_scheme, "calibrated_layers": len(self.scales), "scales": self.scales}
