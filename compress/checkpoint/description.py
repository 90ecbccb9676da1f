"""The compressed-tensors description of a compressed model: the formats this project writes and reads, and the
``quantization_config`` (config groups, ignore list, KV scheme) that config.json carries for vLLM and transformers."""

from __future__ import annotations

import json
import re

import torch
from torch import nn

from compress.errors import CompressError
from compress.moe import checkpoint_name, router_names
from compress.qlinear import Fp4Linear, Fp8BlockLinear, Fp8Linear, Int8Linear, QuantizedLinear

FORMAT = "pack-quantized"
INT_FORMAT = "int-quantized"  # W8A8 int8: int8 `weight`, `weight_scale [out, 1]`, activations quantized per token
FLOAT_FORMAT = "float-quantized"  # FP8 e4m3 `weight`, `weight_scale [out, 1]`, optional static `input_scale`
NVFP4_FORMAT = "nvfp4-pack-quantized"  # uint8 `weight_packed`, fp8 `weight_scale`, fp32 `weight_global_scale`
MXFP4_FORMAT = "mxfp4-pack-quantized"  # uint8 `weight_packed`, uint8 e8m0 `weight_scale`
MIXED_FORMAT = "mixed-precision"  # several of the above; each config group names its own format
ACTIVATION_QUANTIZED = (Int8Linear, Fp8Linear)
DENSE = "dense"  # a pruned but unquantized model: plain weights, sparsity recorded in sparsity_config
FLOAT_WEIGHTS = (Fp8BlockLinear, Fp4Linear)  # FP8_BLOCK / NVFP4 / MXFP4 modules, described by _float_weight_groups
READABLE_FORMATS = (FORMAT, INT_FORMAT, FLOAT_FORMAT, NVFP4_FORMAT, MXFP4_FORMAT, MIXED_FORMAT, DENSE)


def _scheme_key(module: QuantizedLinear) -> tuple:
    channel = module.group_size == module.in_features
    return (module.num_bits, module.symmetric, None if channel else module.group_size, module.weight_g_idx is not None)


def quantization_config(model: nn.Module, kv_cache_scheme: dict | None = None) -> dict | None:
    """The ``quantization_config`` block describing the model's ``QuantizedLinear`` modules."""
    model_type = getattr(model.config, "model_type", None)
    quantized = {checkpoint_name(model_type, n): m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    activation_groups = _activation_groups(model) + _float_weight_groups(model)
    if not quantized and not activation_groups and kv_cache_scheme is None:
        return None
    schemes: dict[tuple, list[str]] = {}
    for name, module in quantized.items():
        schemes.setdefault(_scheme_key(module), []).append(name)
    groups = {}
    for index, ((bits, symmetric, group_size, act_order), names) in enumerate(sorted(schemes.items(), key=str)):
        alone = len(schemes) == 1 and not activation_groups  # "Linear" would also match the W8A8 modules
        targets = ["Linear"] if alone else [f"re:^{re.escape(n)}$" for n in names]
        groups[f"group_{index}"] = {
            "targets": targets,
            "weights": {
                "num_bits": bits,
                "type": "int",
                "symmetric": symmetric,
                "strategy": "channel" if group_size is None else "group",
                "group_size": group_size,
                "dynamic": False,
                "actorder": "group" if act_order else None,
            },
            "input_activations": None,
            "output_activations": None,
            "format": FORMAT,
        }
    for index, group in enumerate(activation_groups, start=len(groups)):
        groups[f"group_{index}"] = group
    formats = sorted({group["format"] for group in groups.values()})
    dense = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    dense += [name for name in router_names(model) if name not in dense]  # vLLM builds routers as linears
    dense = [checkpoint_name(model_type, name) for name in dense]
    return {
        "quant_method": "compressed-tensors",
        "format": formats[0] if len(formats) == 1 else (MIXED_FORMAT if formats else DENSE),
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": dense,
        "kv_cache_scheme": kv_cache_scheme,
    }


def _activation_groups(model: nn.Module) -> list[dict]:
    """Config groups of the W8A8 modules (int8 or fp8 weights per channel; dynamic per-token or static per-tensor
    activations), one per distinct scheme."""
    by_scheme: dict[tuple[str, bool], list[str]] = {}
    model_type = getattr(model.config, "model_type", None)
    for name, module in model.named_modules():
        if isinstance(module, ACTIVATION_QUANTIZED):
            kind = "int" if isinstance(module, Int8Linear) else "float"
            static = getattr(module, "input_scale", None) is not None
            by_scheme.setdefault((kind, static), []).append(checkpoint_name(model_type, name))
    single = len(by_scheme) == 1 and not any(isinstance(m, QuantizedLinear) for m in model.modules())
    groups = []
    for (kind, static), names in sorted(by_scheme.items()):
        groups.append(
            {
                "targets": ["Linear"] if single else [f"re:^{re.escape(n)}$" for n in names],
                "weights": {
                    "num_bits": 8,
                    "type": kind,
                    "symmetric": True,
                    "strategy": "channel",
                    "group_size": None,
                    "dynamic": False,
                    "actorder": None,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": kind,
                    "symmetric": True,
                    "strategy": "tensor" if static else "token",
                    "group_size": None,
                    "dynamic": not static,
                    "actorder": None,
                },
                "output_activations": None,
                "format": INT_FORMAT if kind == "int" else FLOAT_FORMAT,
            }
        )
    return groups


def _float_scheme(module: nn.Module) -> dict:
    """``weights`` and ``input_activations`` of an FP8-block or FP4 module, exactly as compressed-tensors 0.20 writes
    its ``FP8_BLOCK``, ``NVFP4A16``, ``NVFP4``, ``MXFP4A16`` and ``MXFP4`` presets, and the group's format."""
    if isinstance(module, Fp8BlockLinear):
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "block"}
        weights.update(block_structure=[128, 128], dynamic=False)
        inputs = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": 128, "strategy": "group"}
        return {"weights": weights, "input_activations": {**inputs, "dynamic": True}, "format": FLOAT_FORMAT}
    nv = module.fmt == "nvfp4"
    args = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16 if nv else 32}
    args.update(strategy="tensor_group" if nv else "group", dynamic=False)
    args["scale_dtype"] = "torch.float8_e4m3fn" if nv else "torch.uint8"
    inputs = None
    if module.quantize_activations:
        inputs = {**args, "dynamic": "local", "observer": "static_minmax"} if nv else {**args, "dynamic": True}
    return {"weights": args, "input_activations": inputs, "format": NVFP4_FORMAT if nv else MXFP4_FORMAT}


def _float_weight_groups(model: nn.Module) -> list[dict]:
    """Config groups of the FP8-block and FP4 modules, one per distinct scheme."""
    by_scheme: dict[str, tuple[dict, list[str]]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FLOAT_WEIGHTS):
            scheme = _float_scheme(module)
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
