"""Load what the gate judges: a compressed-tensors checkpoint, a plain HF folder, or a model name."""

from __future__ import annotations

import json
from pathlib import Path

from compress.errors import CompressError
from compress.models import ModelSpec, load_model


def quantization_config(path: Path) -> dict:
    """The ``quantization_config`` of a model folder's config.json (empty when there is none)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        return {}
    return json.loads(config_file.read_text()).get("quantization_config") or {}


def is_compressed_tensors(path: Path) -> bool:
    return quantization_config(path).get("quant_method") == "compressed-tensors"


def load_for_eval(source: str | Path):
    """``(model, tokenizer)`` for a checkpoint path or a model name, in eval mode.

    Our compressed-tensors checkpoints go through ``compress.checkpoint.load_checkpoint`` (it rebuilds our packed
    ``QuantizedLinear`` modules); everything else through ``compress.models.load_model``.
    """
    path = Path(source).expanduser()
    if path.is_dir() and is_compressed_tensors(path):
        from compress.checkpoint import load_checkpoint

        model, tokenizer = load_checkpoint(path)
    else:
        model, tokenizer = load_model(ModelSpec(path=str(source)))
    model.eval()
    return model, tokenizer


def kv_cache_dtype_of(path: Path | None) -> str | None:
    """The KV-cache storage dtype a checkpoint asks for (``int8``/``fp8``), from its ``kv_cache_scheme``: read the
    way the loader reads it, so the gate and the engine agree."""
    if path is None:
        return None
    block = quantization_config(path).get("kv_cache_scheme")
    if not block:
        return None
    from compress.kv_quant import KVCacheScheme

    try:
        return KVCacheScheme.from_dict(block).kv_cache_dtype
    except CompressError as error:
        raise CompressError(f"{path}: {error}") from None
