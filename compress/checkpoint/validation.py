"""A model folder's own files checked before anything loads them, each problem one line naming the file and the fix:
a truncated or corrupt safetensors file, a header whose shape or dtype does not fit the model config.json describes
(a compressed-tensors checkpoint rebuilt on the meta device as its loader builds it), weights lacking tensors the
model needs (saved under other names: transformers would fill them with random values and only log it),
a config.json missing the keys the weights' shapes depend on, and checkpoints of formats compress does not read
(GPTQ-for-Llama's ``qweight``/``qzeros``/``scales``, AutoAWQ's ``quant_config.json``), which transformers would
otherwise load with random weights in every linear, and say so only in a warning.

Reads headers only (no tensor data) and builds the model on the meta device, so it costs a fraction of a second
before a load of minutes. Imports only torch, safetensors and transformers (the engine's loader calls it)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from compress.base.errors import CompressError
from compress.checkpoint.reader import SAFETENSORS_DTYPES, check_compressed, read_config_json

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
    elif headers and config["quantization_config"].get("quant_method") == "compressed-tensors":
        check_compressed(folder, config["quantization_config"])


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
            model = AutoModelForCausalLM.from_config(config)
        expected = model.state_dict()
    except Exception:  # noqa: BLE001 - remote code or a family transformers lacks: the loader reports it
        return
    check_none_missing(folder, model, expected, headers)
    for name, (file, dtype, shape) in headers.items():
        want = expected.get(name)
        if want is None:
            continue
        if shape != tuple(want.shape):
            raise CompressError(
                f"{file}: {name} is stored as {shape} but {folder / 'config.json'} makes it {tuple(want.shape)}; "
                f"the file or config.json is damaged: {RESTORE}"
            )
        stored = SAFETENSORS_DTYPES.get(dtype)
        if stored is not None and stored.is_floating_point != want.dtype.is_floating_point:
            raise CompressError(
                f"{file}: {name} is stored as {str(stored).removeprefix('torch.')} but the model needs a "
                f"{'floating-point' if want.dtype.is_floating_point else 'integer'} tensor; the file's header is "
                "damaged: re-download it or re-save the model"
            )


def check_none_missing(
    folder: Path, model: torch.nn.Module, expected: dict[str, torch.Tensor], headers: Headers
) -> None:
    """Every tensor the model needs is stored, under the name transformers reads it by (its renames of legacy names
    and fused experts applied), or is tied to one stored: transformers fills a missing one with random values and says
    so only in a log line. Tied heads and keys the model declares optional (``_keys_to_ignore_on_load_missing``) may
    be absent; non-persistent buffers are not in the state dict at all."""
    targets = loaded_names(model, expected, list(headers))
    if targets is None:  # a transformers without the renaming API this reads: its loader is left to judge
        return
    present = set().union(*targets.values())
    for tied, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():  # {tied name: its source}
        if tied in present or source in present:
            present |= {tied, source}
    optional = [re.compile(pattern) for pattern in getattr(model, "_keys_to_ignore_on_load_missing", None) or []]
    missing = [name for name in expected if name not in present and not any(p.search(name) for p in optional)]
    if missing:
        files = ", ".join(sorted({file.name for file, _, _ in headers.values()}))
        unused = sorted(name for name, loaded in targets.items() if not loaded & expected.keys())
        seen = f"; it holds {len(unused)} tensors the model has no place for, such as {unused[0]}" if unused else ""
        raise CompressError(
            f"{folder}: {files} lacks {len(missing)} of the {len(expected)} tensors {folder / 'config.json'} "
            f"describes ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}){seen}; transformers would fill "
            f"them with random values: {RESTORE}"
        )


def loaded_names(
    model: torch.nn.Module, expected: dict[str, torch.Tensor], names: list[str]
) -> dict[str, set[str]] | None:
    """For each stored tensor name, the state-dict names transformers loads it into: its renames of legacy names,
    per-expert tensors fused into one, a base-model prefix added or removed, as its own loader applies them. None
    where this transformers lacks the functions its loader renames with (then nothing can be said)."""
    try:
        return _loaded_names(model, expected, names)
    except Exception:  # noqa: BLE001 - another transformers version: the check is skipped, never wrongly refuses
        return None


def _loaded_names(model: torch.nn.Module, expected: dict[str, torch.Tensor], names: list[str]) -> dict[str, set[str]]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    prefix = getattr(model, "base_model_prefix", None)
    loaded = {}
    for name in names:
        renamed, pattern = rename_source_key(name, renamings, converters, prefix, expected)
        if renamed not in expected and name in expected:
            renamed, pattern = name, None
        loaded[name] = {renamed}
        for converter in converters if pattern is not None else []:  # one tensor split into several (qkv -> q, k, v)
            if pattern in converter.source_patterns:
                first = converter.target_patterns[0]
                loaded[name].update(renamed.replace(first, target) for target in converter.target_patterns[1:])
    return loaded
