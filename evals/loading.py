"""What the gate judges, loaded by ``compress.models.load`` (compressed-tensors checkpoints, plain HF folders, model
names), and the KV-cache dtype a checkpoint asks for."""

from __future__ import annotations

from pathlib import Path

from compress.checkpoint import read_quantization_config
from compress.errors import CompressError
from compress.kv_quant import KVCacheScheme
from compress.models import load


def load_for_eval(source: str | Path):
    """``(model, tokenizer)`` with every layer in memory: the gate moves models between devices and runs them
    whole."""
    return load(source, lazy=False)


def kv_cache_dtype_of(path: Path | None) -> str | None:
    """The KV-cache storage dtype a checkpoint asks for (``int8``/``fp8``), from its ``kv_cache_scheme``: read the
    way the loader reads it, so the gate and the engine agree."""
    block = read_quantization_config(path).get("kv_cache_scheme") if path is not None else None
    if not block:
        return None
    try:
        return KVCacheScheme.from_dict(block).kv_cache_dtype
    except CompressError as error:
        raise CompressError(f"{path}: {error}") from None
