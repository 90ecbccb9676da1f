"""The compressed-tensors description of a compressed model: the formats this project writes and reads, and the
``quantization_config`` (config groups, ignore list, KV scheme) that config.json carries for vLLM and transformers."""

from __future__ import annotations

import json
import re

import torch
from torch import nn

from compress.base.errors import CompressError
from compress.formats import (
    Fp4Linear,
    Fp8BlockLinear,
    Fp8Linear,
    Int8Linear,
    QuantizedLinear,
    fp4_linear,
    fp8_block_linear,
    w4a16_linear,
    w8a8_linear,
)
from compress.formats.moe_experts import checkpoint_name, router_names

MIXED_FORMAT = "mixed-precision"  # several formats; each config group names its own
DENSE = "dense"  # a pruned but unquantized model: plain weights
ACTIVATION_QUANTIZED = (Int8Linear, Fp8Linear)
FLOAT_WEIGHTS = (Fp8BlockLinear, Fp4Linear)  # FP8_BLOCK / NVFP4 / MXFP4 modules, described by _float_weight_groups
READABLE_FORMATS = (
    w4a16_linear.FORMAT,
    w8a8_linear.INT_FORMAT,
    w8a8_linear.FLOAT_FORMAT,
    fp4_linear.NVFP4_FORMAT,
    fp4_linear.MXFP4_FORMAT,
    MIXED_FORMAT,
    DENSE,
)


def quantization_config(model: nn.Module, kv_cache_scheme: dict | None = None) -> dict | None:
    """The ``quantization_config`` block describing the model's quantized modules, one config group per scheme (each
    format module writes its own group): packed integer groups first, then W8A8, then FP8-block and FP4."""
    model_type = getattr(model.config, "model_type", None)
    quantized = {checkpoint_name(model_type, n): m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    activation_groups = _activation_groups(model) + _float_weight_groups(model)
    if not quantized and not activation_groups and kv_cache_scheme is None:
        return None
    schemes: dict[tuple, list[str]] = {}
    for name, module in sorted(quantized.items(), key=lambda item: natural(item[0])):
        schemes.setdefault(w4a16_linear.scheme_key(module), []).append(name)
    groups = {}
    for index, (key, names) in enumerate(sorted(schemes.items(), key=str)):
        alone = len(schemes) == 1 and not activation_groups  # "Linear" would also match the W8A8 modules
        targets = ["Linear"] if alone else [f"re:^{re.escape(n)}$" for n in names]
        groups[f"group_{index}"] = {"targets": targets, **w4a16_linear.config_group(*key)}
    for index, group in enumerate(activation_groups, start=len(groups)):
        groups[f"group_{index}"] = group
    formats = sorted({group["format"] for group in groups.values()})
    dense = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    dense += [name for name in router_names(model) if name not in dense]  # vLLM builds routers as linears
    dense = sorted((checkpoint_name(model_type, name) for name in dense), key=natural)
    return {
        "quant_method": "compressed-tensors",
        "format": formats[0] if len(formats) == 1 else (MIXED_FORMAT if formats else DENSE),
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": dense,
        "kv_cache_scheme": kv_cache_scheme,
    }


def natural(name: str) -> tuple:
    """Sort key of a module name with its numbers as numbers (``layers.2`` before ``layers.10``): config.json lists
    names in this order, not the module tree's, so a writer that walks the safetensors files instead of the modules
    (``compress.compression.model_free``) writes the same config."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def _activation_groups(model: nn.Module) -> list[dict]:
    """Config groups of the W8A8 modules (int8 or fp8 weights per channel; dynamic per-token or static per-tensor
    activations), one per distinct scheme."""
    by_scheme: dict[tuple[str, bool], list[str]] = {}
    model_type = getattr(model.config, "model_type", None)
    for name, module in sorted(model.named_modules(), key=lambda item: natural(item[0])):
        if isinstance(module, ACTIVATION_QUANTIZED):
            by_scheme.setdefault(w8a8_linear.scheme_key(module), []).append(checkpoint_name(model_type, name))
    single = len(by_scheme) == 1 and not any(isinstance(m, QuantizedLinear) for m in model.modules())
    return [
        {"targets": ["Linear"] if single else [f"re:^{re.escape(n)}$" for n in names], **w8a8_linear.config_group(*key)}
        for key, names in sorted(by_scheme.items())
    ]


def _float_weight_groups(model: nn.Module) -> list[dict]:
    """Config groups of the FP8-block and FP4 modules, one per distinct scheme."""
    by_scheme: dict[str, tuple[dict, list[str]]] = {}
    for name, module in sorted(model.named_modules(), key=lambda item: natural(item[0])):
        if isinstance(module, FLOAT_WEIGHTS):
            scheme = (fp8_block_linear if isinstance(module, Fp8BlockLinear) else fp4_linear).config_group(module)
            by_scheme.setdefault(json.dumps(scheme, sort_keys=True), (scheme, []))[1].append(name)
    others = (QuantizedLinear, *ACTIVATION_QUANTIZED)
    single = len(by_scheme) == 1 and not any(isinstance(m, others) for m in model.modules())
    groups = []
    for _, (scheme, names) in sorted(by_scheme.items()):
        targets = ["Linear"] if single else [f"re:^{re.escape(n)}$" for n in names]
        groups.append({"targets": targets, **scheme, "output_activations": None})
    return groups


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype | str:
    """``"auto"`` passes through (the checkpoint's own dtype); anything else must be a supported dtype."""
    if name == "auto":
        return name
    if name not in DTYPES:
        raise CompressError(f"model.dtype={name!r} is not supported; use auto or one of {sorted(DTYPES)}")
    return DTYPES[name]


def source_dtype(config) -> torch.dtype:
    """The dtype a checkpoint was saved in (``dtype``, older ``torch_dtype``); float32 when the config says nothing."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    value = getattr(torch, value) if isinstance(value, str) else value
    return value if value in DTYPES.values() else torch.float32
