"""Reading a compressed-tensors folder back: its tensors rebuilt into the quantized linears (and KV scales) that
the engine and the evaluations run."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from compress.base.errors import CompressError
from compress.checkpoint.description import READABLE_FORMATS, source_dtype, torch_dtype
from compress.formats import Fp4Linear, Fp8BlockLinear, Fp8Linear, Int8Linear, QuantizedLinear
from compress.formats.moe_experts import checkpoint_name, model_name, unfuse_experts
from compress.kernels.packing import unpack_int32


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CompressError(f"{folder} holds no *.safetensors weights; is it a compress checkpoint?")
    tensors = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensors[key] = handle.get_tensor(key)
        except (SafetensorError, OSError, ValueError) as error:
            raise CompressError(
                f"checkpoint file {file} is corrupt or truncated ({error}); re-create the checkpoint"
            ) from error
    return tensors


def _module_group(name: str, qconfig: dict) -> dict | None:
    """The config group that targets module ``name`` (None if ignored or untargeted)."""
    if name in qconfig.get("ignore", []):
        return None
    for group in qconfig["config_groups"].values():
        for target in group["targets"]:
            if target == "Linear" or (target.startswith("re:") and re.search(target[3:], name)):
                return group
    return None


def _module_scheme(name: str, qconfig: dict) -> dict | None:
    group = _module_group(name, qconfig)
    return None if group is None else group["weights"]


def _quantized_module(name: str, weights: dict, tensors: dict[str, torch.Tensor], dense: nn.Linear) -> QuantizedLinear:
    out_features, in_features = (int(v) for v in tensors.pop(f"{name}.weight_shape"))
    bits = weights["num_bits"]
    group_size = weights.get("group_size") or in_features
    zero = tensors.pop(f"{name}.weight_zero_point", None)
    if zero is not None:
        zero = unpack_int32(zero, bits, out_features, dim=0)
    g_idx = tensors.pop(f"{name}.weight_g_idx", None)
    bias = tensors.pop(f"{name}.bias", None)
    scale = tensors.pop(f"{name}.weight_scale")
    if (out_features, in_features) != (dense.out_features, dense.in_features):
        raise CompressError(f"{name}: stored shape {(out_features, in_features)} does not match the model config")
    packed = tensors.pop(f"{name}.weight_packed")
    return QuantizedLinear.from_packed(packed, scale, zero, bits, group_size, (out_features, in_features), bias, g_idx)


def _replace_activation_quantized(model: nn.Module, name: str, dense: nn.Linear, tensors: dict) -> None:
    """An empty Int8Linear/Fp8Linear (chosen by the stored weight dtype) in place of ``dense``; load_state_dict
    fills its buffers."""
    stored = tensors[f"{name}.weight"].dtype
    if stored == torch.int8:
        module = Int8Linear(dense.in_features, dense.out_features, dense.bias is not None, dense.weight.dtype)
    elif stored == torch.float8_e4m3fn:
        module = Fp8Linear(
            dense.in_features,
            dense.out_features,
            dense.bias is not None,
            dense.weight.dtype,
            static_input_scale=f"{name}.input_scale" in tensors,
        )
    else:
        raise CompressError(f"{name}: weight_scale stored with a {stored} weight; expected int8 or float8_e4m3fn")
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def _is_float_weight(name: str, qconfig: dict, tensors: dict) -> bool:
    """FP4 (uint8 ``weight_packed``) or FP8-block (``strategy: block``) weights: the formats ``FLOAT_WEIGHTS`` hold."""
    packed = tensors.get(f"{name}.weight_packed")
    if packed is not None:
        return packed.dtype == torch.uint8
    weights = _module_scheme(name, qconfig) if f"{name}.weight_scale" in tensors else None
    return weights is not None and weights.get("strategy") == "block"


def _replace_float_weight(model: nn.Module, name: str, dense: nn.Linear, qconfig: dict, tensors: dict) -> None:
    """An empty Fp8BlockLinear/Fp4Linear shaped and typed like the stored tensors in place of ``dense``;
    load_state_dict fills its buffers."""
    bias, dtype = dense.bias is not None, dense.weight.dtype
    if f"{name}.weight_packed" in tensors:
        group = _module_group(name, qconfig)
        fmt = "nvfp4" if tensors[f"{name}.weight_scale"].dtype == torch.float8_e4m3fn else "mxfp4"
        activations = group is not None and group.get("input_activations") is not None
        module = Fp4Linear(dense.in_features, dense.out_features, fmt, bias, dtype, activations)
    else:
        scale_dtype = tensors[f"{name}.weight_scale"].dtype
        module = Fp8BlockLinear(dense.in_features, dense.out_features, bias, dtype, scale_dtype)
    for key, buffer in module.state_dict().items():
        stored = tensors.get(f"{name}.{key}")
        if stored is not None and stored.shape != buffer.shape:
            raise CompressError(
                f"{name}.{key}: stored shape {tuple(stored.shape)} does not match the model config "
                f"({tuple(buffer.shape)}); the checkpoint belongs to another model"
            )
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)


def _attach_kv_scales(model: nn.Module, block: dict | None, tensors: dict, folder: Path) -> None:
    """``k_scale``/``v_scale`` buffers on every attention module, with K/V quantized as a runtime would."""
    if block is None:
        return
    from compress.grids.kv_quant import KVCacheScheme, attention_modules, route_attention, set_scales

    scheme = KVCacheScheme.from_dict(block)
    for name, attention in attention_modules(model).items():
        if f"{name}.k_scale" not in tensors or f"{name}.v_scale" not in tensors:
            raise CompressError(f"{folder}: kv_cache_scheme is set but {name}.k_scale/v_scale are missing")
        set_scales(attention, tensors[f"{name}.k_scale"], tensors[f"{name}.v_scale"], scheme)
    route_attention(model)


def read_quantization_config(folder: Path) -> dict:
    """The ``quantization_config`` of a model folder's config.json; empty when it has none (a plain HF folder)."""
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        return {}
    return read_config_json(config_file).get("quantization_config") or {}


def read_config_json(config_file: Path) -> dict:
    """A model's config.json, or one line saying it is damaged (a truncated copy, an interrupted download)."""
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CompressError(
            f"{config_file} is not valid JSON ({error}); restore it from the model's source or re-save the model"
        ) from None
    if not isinstance(config, dict):
        raise CompressError(f"{config_file} holds {type(config).__name__}, not a model config; restore it")
    return config


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside hold their parameters on the meta device (no memory, no random initialization) and their
    buffers for real: the file fills every parameter, but non-persistent buffers (rotary frequencies) exist only as
    the model computes them when built."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def header_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors on the meta device, shaped and typed as their headers say, but for the few whose values
    building a layer reads (``VALUES_READ``: a layer's dense shape, K/V scales), read for real. A file that cannot be
    opened is named."""
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    view = handle.get_slice(key)
                    if key.endswith(VALUES_READ):
                        tensors[key] = handle.get_tensor(key)
                    else:
                        dtype = SAFETENSORS_DTYPES[view.get_dtype()]
                        tensors[key] = torch.empty(tuple(view.get_shape()), dtype=dtype, device="meta")
        except (SafetensorError, OSError, ValueError, KeyError) as error:
            raise CompressError(f"checkpoint file {file} is corrupt or truncated ({error}); re-create it") from None
    return tensors


VALUES_READ = (".weight_shape", ".k_scale", ".v_scale")
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}  # fmt: skip


def check_compressed(folder: Path, qconfig: dict) -> None:
    """The checkpoint rebuilt on the meta device from its headers, as :func:`load_compressed` builds it: a header
    that lies about a shape or dtype, or a tensor missing, fails here in one line in a fraction of a second, before a
    command opens a run or reads a weight."""
    load_compressed(folder, qconfig, "auto", header_tensors(folder))


def load_compressed(
    folder: Path, qconfig: dict, dtype: str, stored: dict[str, torch.Tensor] | None = None
) -> nn.Module:
    """A compressed-tensors checkpoint with our quantized modules in place, in the dtype it was saved in; ``stored``:
    its tensors already read (:func:`check_compressed` passes meta ones), else they are read from the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if qconfig.get("format") not in READABLE_FORMATS:
        raise CompressError(
            f"{folder}: quantization compressed-tensors/{qconfig.get('format')} is not readable here; "
            f"compress loads compressed-tensors {', '.join(READABLE_FORMATS)}"
        )
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config
    saved = source_dtype(config)
    if dtype != "auto" and torch_dtype(dtype) != saved:
        raise CompressError(
            f"{folder} is a quantized checkpoint saved in {saved}; it loads in that dtype only: use dtype=auto"
        )
    model_type = getattr(config, "model_type", None)
    stored = _read_tensors(folder) if stored is None else stored
    tensors = {model_name(model_type, key): value for key, value in stored.items()}
    with parameters_on_meta():  # the quantized modules replace most of them: never allocate the dense weights
        model = AutoModelForCausalLM.from_config(config, dtype=saved)
    unfuse_experts(model)  # the checkpoint stores one linear per expert
    try:
        missing, unexpected = _fill(model, folder, qconfig, tensors)
    except (RuntimeError, ValueError, IndexError, KeyError) as error:  # a header that lies about a shape or dtype
        files = sorted(folder.glob("*.safetensors"))
        reason = " ".join(str(error).split())[:300]
        raise CompressError(
            f"{files[0] if len(files) == 1 else folder}: the stored tensors do not fit {folder / 'config.json'} "
            f"({type(error).__name__}: {reason}); the checkpoint is damaged: re-create it"
        ) from None
    allowed_missing = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    # QuantizedLinear buffers were filled directly above; everything else must come from the file.
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    missing = [k for k in missing if k not in allowed_missing and k.rpartition(".")[0] not in quantized]
    if missing or unexpected:
        raise CompressError(
            f"{folder}: weights do not match the model config (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    if allowed_missing:
        model.tie_weights()
    return model


def _fill(model: nn.Module, folder: Path, qconfig: dict, tensors: dict) -> tuple[list[str], list[str]]:
    """The quantized modules put in place and every tensor loaded: ``(missing, unexpected)`` keys."""
    model_type = getattr(model.config, "model_type", None)
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and _is_float_weight(name, qconfig, tensors):
            _replace_float_weight(model, name, module, qconfig, tensors)
        elif type(module) is nn.Linear and f"{name}.weight_packed" in tensors:
            weights = _module_scheme(checkpoint_name(model_type, name), qconfig)
            if weights is None:
                raise CompressError(f"{folder}: {name} is packed but no config group targets it")
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, _quantized_module(name, weights, tensors, module))
        elif type(module) is nn.Linear and f"{name}.weight_scale" in tensors:
            _replace_activation_quantized(model, name, module, tensors)
    _attach_kv_scales(model, qconfig.get("kv_cache_scheme"), tensors, folder)
    expected = model.state_dict()  # the file's tensors take the modules' dtypes, as a copy into them would
    for key, value in tensors.items():  # ... but an integer tensor is never read as floats, nor the reverse
        if key in expected and value.is_floating_point() != expected[key].is_floating_point():
            raise ValueError(f"{key} is stored as {value.dtype}, the model needs {expected[key].dtype}")
    tensors = {key: value.to(expected[key].dtype) if key in expected else value for key, value in tensors.items()}
    return model.load_state_dict(tensors, strict=False, assign=True)
