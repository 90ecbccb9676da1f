"""A model folder's own files checked before anything loads them, each problem one line naming the file and the fix:
a truncated or corrupt safetensors file, a header whose shape or dtype does not fit the model config.json describes,
a config.json missing the keys the weights' shapes depend on, and checkpoints of formats compress does not read
(GPTQ-for-Llama's ``qweight``/``qzeros``/``scales``, AutoAWQ's ``quant_config.json``), which transformers would
otherwise load with random weights in every linear, and say so only in a warning.

Reads headers only (no tensor data) and builds the model on the meta device, so it costs a fraction of a second
before a load of minutes. Imports only torch, safetensors and transformers (the engine's loader calls it)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from compress.base.errors import CompressError
from compress.checkpoint.reader import read_config_json

PACKED_SUFFIXES = (".qweight", ".qzeros")  # GPTQ-for-Llama, AutoGPTQ and AutoAWQ store int4 linears as these
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size")  # what the plan and every loader read first
RESTORE = "restore it from the model's source (or re-save the model with save_pretrained)"

Headers = dict[str, tuple[Path, str, tuple[int, ...]]]  # tensor name: (file, safetensors dtype, shape)


def check_model_files(folder: Path) -> None:
    """Raise one CompressError line for the first damaged or foreign file of the model folder ``folder``."""
    config_file = folder / "config.json"
    config = read_config_json(config_file)
    headers = read_headers(folder)
    quantized = bool(config.get("quantization_config"))
    if (folder / "quant_config.json").is_file() and not quantized:
        raise CompressError(
            f"{folder / 'quant_config.json'}: an AutoAWQ checkpoint (int4 qweight/qzeros/scales), a format compress "
            "does not read; give the original dense model, or a compressed-tensors checkpoint (recipe=awq_int4)"
        )
    packed = next((name for name in headers if name.endswith(PACKED_SUFFIXES)), None)
    if packed is not None and not quantized:
        raise CompressError(
            f"{headers[packed][0]}: {packed} and no quantization_config in config.json: a GPTQ-for-Llama checkpoint, "
            "a format compress does not read (transformers would load its linears as random weights); give the "
            "original dense model, or a compressed-tensors checkpoint (recipe=gptq_int4)"
        )
    if headers:  # pickle weights (model.allow_pickle) go to transformers' own load unchecked
        check_config_keys(config_file, config)
    if headers and not quantized:
        check_weights_fit(folder, headers)


def read_headers(folder: Path) -> Headers:
    """Every ``*.safetensors`` file's tensor names, dtypes and shapes; a file that cannot be opened is named."""
    headers: Headers = {}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    view = handle.get_slice(name)
                    headers[name] = (file, view.get_dtype(), tuple(view.get_shape()))
        except (SafetensorError, OSError, ValueError) as error:
            reason = " ".join(str(error).split())
            raise CompressError(
                f"{file} is corrupt or truncated ({reason}): re-create the checkpoint, or re-download the model"
            ) from None
    return headers


def check_config_keys(config_file: Path, config: dict) -> None:
    """config.json names its family and the sizes the weights were saved with: transformers fills a missing size
    with its family's default (hidden 4096, 32 layers), a model the weights do not fit."""
    if not config.get("model_type"):
        raise CompressError(f"{config_file} has no model_type (llama, qwen2, ...): {RESTORE}")
    text = config.get("text_config") or config
    aliases = _attribute_map(text.get("model_type") or config["model_type"])
    missing = [key for key in SHAPE_KEYS if key not in text and aliases.get(key) not in text]
    if missing:
        raise CompressError(
            f"{config_file} lacks {', '.join(missing)}, which the weights' shapes depend on (transformers would "
            f"take its defaults): {RESTORE}"
        )


def _attribute_map(model_type: str) -> dict:
    """The family's other names for the standard keys (GPT-2's ``n_embd`` for ``hidden_size``)."""
    from transformers import CONFIG_MAPPING

    return dict(CONFIG_MAPPING[model_type].attribute_map) if model_type in CONFIG_MAPPING else {}


def check_weights_fit(folder: Path, headers: Headers) -> None:
    """Each stored tensor the model config.json describes has the shape and kind of dtype the model needs: a header
    that lies fails here in one line, not in a layer's load halfway through a run."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            expected = AutoModelForCausalLM.from_config(config).state_dict()
    except Exception:  # noqa: BLE001 - remote code or a family transformers lacks: the loader reports it
        return
    for name, (file, dtype, shape) in headers.items():
        want = expected.get(name)
        if want is None:
            continue
        if shape != tuple(want.shape):
            raise CompressError(
                f"{file}: {name} is stored as {shape} but {folder / 'config.json'} makes it {tuple(want.shape)}; "
                f"the file or config.json is damaged: {RESTORE}"
            )
        stored = _torch_dtype(dtype)
        if stored is not None and stored.is_floating_point != want.dtype.is_floating_point:
            raise CompressError(
                f"{file}: {name} is stored as {str(stored).removeprefix('torch.')} but the model needs a "
                f"{'floating-point' if want.dtype.is_floating_point else 'integer'} tensor; the file's header is "
                "damaged: re-download it or re-save the model"
            )


def _torch_dtype(name: str) -> torch.dtype | None:
    """torch's dtype for a safetensors dtype name (``F32``, ``BF16``, ``I32``, ``F8_E4M3``)."""
    names = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
             "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
             "F8_E5M2": "float8_e5m2"}  # fmt: skip
    return getattr(torch, names[name], None) if name in names else None
